"""The loss mask of agent conversations (tools, calls, tool results, reasoning) checked against
an oracle that does not use the product's code: for each trained turn t, the text that
render(conv[:t+1]) adds to render(conv[:t]) (with the generation prompt for an assistant turn),
tokenized alone. The templates under tests/templates are written in the manner of Qwen2.5,
Llama 3.1 and Qwen3; the tokenizer is the session's byte-level BPE (`bpe_tok`).

Rows are encoded with encode_chat_batch in-process, as the tokenize stage's map does.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from finetune.datatypes.chat import encode_chat_batch, normalise
from finetune.errors import PipelineError

TEMPLATES = Path(__file__).parent / "templates"
IGNORE = -100
MAX_LEN = 4096
#: The end-of-turn marker each template closes a turn with.
END_OF_TURN = {"qwen2.5-tools": "<|im_end|>\n", "llama3.1-tools": "<|eot_id|>",
               "qwen3-reasoning": "<|im_end|>\n"}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def tool(name: str, description: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(props),
                       "properties": {k: {"type": v} for k, v in props.items()}}}}


def call(name: str, call_id: str, **arguments) -> dict:
    return {"type": "function", "id": call_id,
            "function": {"name": name, "arguments": arguments}}


TOOLS = [tool("get_weather", "The weather of a city now", city="string"),
         tool("add", "The sum of two integers", a="integer", b="integer")]
PARIS = '{"city": "Paris", "temp_c": 21, "sky": "sunny"}'
TOKYO = '{"city": "Tokyo", "temp_c": 9, "sky": "rain"}'
SUM = '{"result": 42}'

#: Two calls in one assistant turn, their two results (one user block in ChatML), an answer.
PARALLEL = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris and in Tokyo?"},
    {"role": "assistant", "content": "",
     "tool_calls": [call("get_weather", "call_0", city="Paris"),
                    call("get_weather", "call_1", city="Tokyo")]},
    {"role": "tool", "content": PARIS, "tool_call_id": "call_0", "name": "get_weather"},
    {"role": "tool", "content": TOKYO, "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "assistant", "content": "Paris is sunny at 21 degrees; Tokyo has rain at 9."},
]
#: One call per assistant turn (Llama 3.1 takes one at a time): two calls, two results.
SEQUENTIAL = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "How warm is Paris? Then add 17 and 25."},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "c0", city="Paris")]},
    {"role": "tool", "content": PARIS, "tool_call_id": "c0"},
    {"role": "assistant", "content": "", "tool_calls": [call("add", "c1", a=17, b=25)]},
    {"role": "tool", "content": SUM, "tool_call_id": "c1"},
    {"role": "assistant", "content": "Paris is 21 degrees, and 17 + 25 is 42."},
]
#: No tools at all, two user turns.
PLAIN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "How many people live in Tokyo?"},
    {"role": "assistant", "content": "About 14 million people live in Tokyo."},
]
TOOL_RESULTS = (PARIS, TOKYO, SUM)

#: Two user turns; the first answer has reasoning that Qwen3 drops once a later user turn
#: follows, so that answer, with its reasoning, is trained in a sequence of its own.
THINKING = [
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "17 + 25 is 42.",
     "reasoning_content": "First add the numbers: 17 plus 25 makes 42."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris.",
     "reasoning_content": "Let me think step by step: the capital is Paris."},
]
#: After the last user turn: a call with reasoning, its result, an answer with reasoning.
THINKING_TOOLS = [
    {"role": "user", "content": "How warm is Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should check the weather.",
     "tool_calls": [call("get_weather", "c0", city="Paris")]},
    {"role": "tool", "content": PARIS, "tool_call_id": "c0"},
    {"role": "assistant", "content": "Paris is sunny at 21 degrees.",
     "reasoning_content": "The tool says 21 and sunny."},
]
REASONINGS = [m["reasoning_content"] for c in (THINKING, THINKING_TOOLS) for m in c
              if "reasoning_content" in m]


def render(tok, name: str, conv: list[dict], tools, generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(conv, tools=tools or None, chat_template=template(name),
                                   tokenize=False, add_generation_prompt=generation_prompt)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def oracle_pieces(tok, name: str, conv: list[dict], tools, roles) -> list[str]:
    """The text each trained turn adds to the rendering, in order."""
    pieces = []
    for t, m in enumerate(conv):
        if m["role"] not in roles:
            continue
        before = render(tok, name, conv[:t], tools, generation_prompt=m["role"] == "assistant")
        through = render(tok, name, conv[:t + 1], tools)
        assert through.startswith(before), (name, t)
        pieces.append(through[len(before):])
    return pieces


def encode(tok, name: str, convs: list[list[dict]], tools, roles=("assistant",), eos=True,
           reasoning=True) -> dict[str, list]:
    batch = {"messages": [json.dumps(c) for c in convs],
             "tools": [json.dumps(tools or []) for _ in convs]}
    return encode_chat_batch(batch, tok, template(name), bos=None, max_len=MAX_LEN,
                             roles=list(roles), last_only=False, eos=eos, reasoning=reasoning)


def trained(labels: list[int]) -> list[int]:
    return [x for x in labels if x != IGNORE]


def trained_runs(row_ids: list[int], labels: list[int]) -> list[list[int]]:
    """The trained stretches of a row (turns are parted by untrained headers)."""
    runs, current = [], []
    for token, label in zip(row_ids, labels):
        if label == IGNORE:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    return runs + ([current] if current else [])


AGENT_CASES = [pytest.param("qwen2.5-tools", PARALLEL, id="qwen2.5-parallel"),
               pytest.param("qwen2.5-tools", SEQUENTIAL, id="qwen2.5-sequential"),
               pytest.param("llama3.1-tools", SEQUENTIAL, id="llama3.1-sequential")]


@pytest.mark.parametrize("name,conv", AGENT_CASES)
def test_templates_render_every_prefix_as_the_start_of_the_whole(bpe_tok, name, conv):
    """The templates are the kind the one-sequence mask is for: each assistant turn's
    generation prompt and rendering are prefixes of the whole conversation's rendering."""
    full = render(bpe_tok, name, conv, TOOLS)
    for t, m in enumerate(conv):
        if m["role"] == "assistant":
            assert full.startswith(render(bpe_tok, name, conv[:t], TOOLS, True))
            assert full.startswith(render(bpe_tok, name, conv[:t + 1], TOOLS))
    assert "<tool_call>" in full or "parameters" in full
    assert all(result in full for result in TOOL_RESULTS if result in json.dumps(conv))


@pytest.mark.parametrize("name,conv", AGENT_CASES)
def test_assistant_turns_train_exactly_the_oracle_tokens(bpe_tok, name, conv):
    out = encode(bpe_tok, name, [conv, PLAIN], TOOLS)
    assert len(out["input_ids"]) == 2
    for row, c in enumerate([conv, PLAIN]):
        row_ids, labels = out["input_ids"][row], out["labels"][row]
        pieces = oracle_pieces(bpe_tok, name, c, TOOLS, ["assistant"])
        assert row_ids == ids(bpe_tok, render(bpe_tok, name, c, TOOLS))
        assert trained(labels) == [i for p in pieces for i in ids(bpe_tok, p)]
        assert trained_runs(row_ids, labels) == [ids(bpe_tok, p) for p in pieces]
        assert out["n_trainable"][row] == len(trained(labels))
        text = bpe_tok.decode(trained(labels))
        assert not any(result in text for result in TOOL_RESULTS)
        assert not any(m["content"] in text for m in c if m["role"] in ("user", "system"))
    # the calls are trained: their names and arguments are in the trained text
    text = bpe_tok.decode(trained(out["labels"][0]))
    assert '"name": "get_weather"' in text and '"city": "Paris"' in text
    assert text.count(END_OF_TURN[name]) == sum(m["role"] == "assistant" for m in conv)


@pytest.mark.parametrize("name,conv", AGENT_CASES + [
    pytest.param("qwen3-reasoning", THINKING_TOOLS, id="qwen3-thinking-tools")])
def test_train_on_eos_off_leaves_the_end_of_turn_marker_untrained(bpe_tok, name, conv):
    out = encode(bpe_tok, name, [conv], TOOLS, eos=False)
    marker = END_OF_TURN[name]
    pieces = oracle_pieces(bpe_tok, name, conv, TOOLS, ["assistant"])
    assert all(p.endswith(marker) for p in pieces)
    row_ids, labels = out["input_ids"][0], out["labels"][0]
    assert row_ids == ids(bpe_tok, render(bpe_tok, name, conv, TOOLS))
    runs = [bpe_tok.decode(run) for run in trained_runs(row_ids, labels)]
    assert runs == [p[:-len(marker)] for p in pieces]
    assert marker.strip() not in bpe_tok.decode(trained(labels))


@pytest.mark.parametrize("name,conv", AGENT_CASES)
def test_last_turn_only_trains_the_final_answer_alone(bpe_tok, name, conv):
    batch = {"messages": [json.dumps(conv)], "tools": [json.dumps(TOOLS)]}
    out = encode_chat_batch(batch, bpe_tok, template(name), bos=None, max_len=MAX_LEN,
                            roles=["assistant"], last_only=True, eos=True, reasoning=True)
    last = oracle_pieces(bpe_tok, name, conv, TOOLS, ["assistant"])[-1]
    assert trained(out["labels"][0]) == ids(bpe_tok, last)
    assert last.startswith(conv[-1]["content"])


@pytest.mark.parametrize("name,conv", AGENT_CASES)
def test_every_token_but_tool_results_trains_without_roles(bpe_tok, name, conv):
    """roles None (assistant_only_loss: false): the whole rendering is trained except each
    block of tool results (the text a run of tool turns adds to the rendering)."""
    batch = {"messages": [json.dumps(conv)], "tools": [json.dumps(TOOLS)]}
    out = encode_chat_batch(batch, bpe_tok, template(name), bos=None, max_len=MAX_LEN,
                            roles=None, last_only=False, eos=True, reasoning=True)
    full = render(bpe_tok, name, conv, TOOLS)
    expected, t = full, 0
    while t < len(conv):
        end = t
        while end < len(conv) and conv[end]["role"] == "tool":
            end += 1
        if end > t:
            block = render(bpe_tok, name, conv[:end], TOOLS)[
                len(render(bpe_tok, name, conv[:t], TOOLS)):]
            assert block in expected and any(r in block for r in TOOL_RESULTS)
            expected = expected.replace(block, "", 1)
        t = end + 1
    assert out["input_ids"][0] == ids(bpe_tok, full)
    assert bpe_tok.decode(trained(out["labels"][0])) == expected


#: SEQUENTIAL as a dataset may write it: arguments as a JSON string, a bare call, a tool result
#: as a mapping, no call ids.
RAW_SEQUENTIAL = [
    SEQUENTIAL[0], SEQUENTIAL[1],
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": json.loads(PARIS)},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "add",
                                                         "arguments": {"a": 17, "b": 25}}]},
    {"role": "tool", "content": SUM},
    SEQUENTIAL[-1],
]


@pytest.mark.parametrize("name", ["qwen2.5-tools", "llama3.1-tools"])
def test_raw_rows_normalise_to_what_the_templates_render(bpe_tok, name):
    conv = normalise(json.dumps(RAW_SEQUENTIAL), None, "row 0")
    assert [c.get("function") for m in conv for c in m.get("tool_calls", [])] == [
        c["function"] for m in SEQUENTIAL for c in m.get("tool_calls", [])]
    assert render(bpe_tok, name, conv, TOOLS) == render(bpe_tok, name, SEQUENTIAL, TOOLS)
    assert encode(bpe_tok, name, [conv], TOOLS) == encode(bpe_tok, name, [SEQUENTIAL], TOOLS)
    thought = normalise([{"role": "user", "content": "What is 17 + 25?"},
                         {"role": "assistant", "content": "<think>\nFirst add the numbers: 17 "
                          "plus 25 makes 42.\n</think>\n\n17 + 25 is 42."}], None, "row 1")
    assert thought == THINKING[:2]


@pytest.mark.parametrize("name", ["qwen2.5-tools", "llama3.1-tools"])
@pytest.mark.parametrize("conv,tools", [(PLAIN, None), (SEQUENTIAL, TOOLS)],
                         ids=["plain", "tools"])
def test_user_turns_are_trained_when_roles_name_them(bpe_tok, name, conv, tools):
    out = encode(bpe_tok, name, [conv], tools, roles=("user", "assistant"))
    pieces = oracle_pieces(bpe_tok, name, conv, tools, ["user", "assistant"])
    row_ids, labels = out["input_ids"][0], out["labels"][0]
    assert row_ids == ids(bpe_tok, render(bpe_tok, name, conv, tools))
    assert trained(labels) == [i for p in pieces for i in ids(bpe_tok, p)]
    text = bpe_tok.decode(trained(labels))
    for m in conv:
        if m["role"] == "user":
            assert m["content"] in text
    assert not any(result in text for result in TOOL_RESULTS)
    assert "You are a helpful assistant." not in text


def rows_of(out) -> list[tuple[list[int], list[int]]]:
    return [(i, trained(lab)) for i, lab in zip(out["input_ids"], out["labels"])]


def test_reasoning_turn_before_a_later_user_turn_is_its_own_sequence(bpe_tok):
    name = "qwen3-reasoning"
    out = encode(bpe_tok, name, [THINKING], None)
    first, last = oracle_pieces(bpe_tok, name, THINKING, None, ["assistant"])
    assert "<think>\nFirst add the numbers" in first and "<think>\nLet me think" in last
    full = render(bpe_tok, name, THINKING, None)
    assert THINKING[1]["reasoning_content"] not in full  # the past turn renders without it
    expected = [(ids(bpe_tok, render(bpe_tok, name, THINKING[:2], None)), ids(bpe_tok, first)),
                (ids(bpe_tok, full), ids(bpe_tok, last))]
    assert len(out["input_ids"]) == 2
    assert sorted(rows_of(out)) == sorted(expected)
    for row_ids, labels in zip(out["input_ids"], out["labels"]):
        assert len(trained_runs(row_ids, labels)) == 1


def test_reasoning_turns_after_the_last_user_turn_share_one_sequence(bpe_tok):
    name = "qwen3-reasoning"
    out = encode(bpe_tok, name, [THINKING_TOOLS], TOOLS)
    pieces = oracle_pieces(bpe_tok, name, THINKING_TOOLS, TOOLS, ["assistant"])
    full = render(bpe_tok, name, THINKING_TOOLS, TOOLS)
    assert rows_of(out) == [(ids(bpe_tok, full), [i for p in pieces for i in ids(bpe_tok, p)])]
    text = bpe_tok.decode(trained(out["labels"][0]))
    assert all(m["reasoning_content"] in text for m in THINKING_TOOLS if m["role"] == "assistant")
    assert PARIS not in text


def test_reasoning_off_trains_the_answers_without_the_reasoning(bpe_tok):
    out = encode(bpe_tok, "qwen3-reasoning", [THINKING, THINKING_TOOLS], TOOLS, reasoning=False)
    texts = [bpe_tok.decode(trained(labels)) for labels in out["labels"]]
    assert texts and all(texts)
    for reasoning in REASONINGS:
        assert not any(reasoning in text for text in texts), reasoning
    # exactly: each turn's oracle text with its reasoning cut out (the think markers stay)
    pieces = oracle_pieces(bpe_tok, "qwen3-reasoning", THINKING_TOOLS, TOOLS, ["assistant"])
    assert texts[-1] == "".join(p.replace(m["reasoning_content"], "") for p, m in zip(
        pieces, [m for m in THINKING_TOOLS if m["role"] == "assistant"]))
    for m in THINKING + THINKING_TOOLS:
        if m["role"] == "assistant" and m["content"]:
            assert any(m["content"] in text for text in texts), m["content"]
    assert any('"city": "Paris"' in text for text in texts)


def test_template_that_drops_reasoning_is_refused_naming_the_row(bpe_tok):
    """Qwen2.5's kind of template never shows reasoning_content: training on reasoning with
    it would silently train nothing of it, so the row is refused in one line."""
    with pytest.raises(PipelineError) as err:
        encode(bpe_tok, "qwen2.5-tools", [PLAIN, THINKING], None, reasoning=True)
    message = str(err.value)
    assert "does not render reasoning_content" in message
    assert "row 1" in message and "\n" not in message


@pytest.mark.parametrize("name,conv", AGENT_CASES)
def test_bos_is_added_once_and_never_trained(bpe_tok, name, conv):
    """Llama's template writes bos_token itself: the encoder must not add a second one;
    ChatML writes none: the encoder's BOS leads the row, untrained."""
    bos = bpe_tok.bos_token_id
    batch = {"messages": [json.dumps(conv)], "tools": [json.dumps(TOOLS)]}
    out = encode_chat_batch(batch, bpe_tok, template(name), bos=bos, max_len=MAX_LEN,
                            roles=["assistant"], last_only=False, eos=True, reasoning=True)
    full = ids(bpe_tok, render(bpe_tok, name, conv, TOOLS))
    assert out["input_ids"][0] == (full if full[0] == bos else [bos] + full)
    assert out["input_ids"][0].count(bos) == 1 and out["labels"][0][0] == IGNORE
    pieces = oracle_pieces(bpe_tok, name, conv, TOOLS, ["assistant"])
    assert trained(out["labels"][0]) == [i for p in pieces for i in ids(bpe_tok, p)]


#: Llama 3.1's own template raises when tools are given and no user message is there yet to
#: put them in: rendering a conversation up to its first user turn fails.
RAISES_WITHOUT_USER = template("llama3.1-tools").replace(
    "{%- if with_tools and rest | length > 0 -%}",
    "{%- if with_tools and rest | length == 0 %}{{ raise_exception('Cannot put tools in the "
    "first user message when there is no first user message!') }}{% endif -%}\n"
    "{%- if with_tools and rest | length > 0 -%}")


def test_template_that_cannot_render_a_prefix_is_one_line_naming_the_row(bpe_tok):
    """Training user turns with tools renders the conversation up to the first user turn,
    which Llama 3.1's template refuses: the run must stop on one line naming the row, not on
    the template's traceback."""
    assert RAISES_WITHOUT_USER != template("llama3.1-tools")
    batch = {"messages": [json.dumps(PLAIN), json.dumps(SEQUENTIAL)],
             "tools": ["[]", json.dumps(TOOLS)]}
    with pytest.raises(PipelineError) as err:
        encode_chat_batch(batch, bpe_tok, RAISES_WITHOUT_USER, bos=None, max_len=MAX_LEN,
                          roles=["user", "assistant"], last_only=False, eos=True,
                          reasoning=True)
    assert "row 1" in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("data.chat_template cannot render row 1 through turn 0 "
                                     "(TemplateError: ")
