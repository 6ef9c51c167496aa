"""Agent data in conversations (finetune/datatypes/conversation.py, tool_calls.py): tool calls,
tool results and reasoning in every form rows write them become the one form templates read;
unsound tool use is a row contract (dropped and counted, the stage fails above
data.max_dropped_fraction naming the row and the rule); held-out turns that call tools are
scored by the called name and the parsed arguments."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from helpers import ROOT
from finetune.config.data import DataConfig
from finetune.datatypes import DataContext
from finetune.datatypes.conversation import normalise, tool_schemas
from finetune.datatypes.tool_calls import parse_tool_calls, score_tool_calls
from finetune.errors import PipelineError

#: a plain template for stories260K (no special tokens) that renders tools, calls and results
TEMPLATE = ("{% if tools %}Tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
            "{{ '\n' }}{% endif %}{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
            "{% elif m['role'] == 'tool' %}Result: {{ m['content'] }}\n"
            "{% else %}Assistant: {{ m['content'] }}{% for c in m.get('tool_calls', []) %}"
            "Call: {{ c['function'] | tojson }}{% endfor %}{{ eos_token }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Assistant: {% endif %}")
CALC = {"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                         "parameters": {"type": "object", "properties": {
                                             "expression": {"type": "string"}}}}}
WHERE = "split 'train' row 4 column 'messages'"


def _call(name="calculator", arguments='{"expression": "48/2"}', **extra):
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


def _row(call=None, result="24", answer="It is 24.", tool_call_id=None):
    tool = {"role": "tool", "content": result}
    if tool_call_id:
        tool["tool_call_id"] = tool_call_id
    return [{"role": "user", "content": "What is 48/2?"},
            {"role": "assistant", "content": "", "tool_calls": [call or _call(id="call_0")]},
            tool, {"role": "assistant", "content": answer}]


def test_every_written_form_becomes_the_form_templates_read():
    want_call = {"type": "function", "function": {"name": "calculator",
                                                  "arguments": {"expression": "48/2"}}}
    # arguments as a JSON string or an object; the bare and Llama (`parameters`) forms
    for call in (_call(), _call(arguments={"expression": "48/2"}),
                 {"name": "calculator", "arguments": {"expression": "48/2"}},
                 {"function": {"name": "calculator", "parameters": {"expression": "48/2"}}}):
        conv = normalise(_row(call), None, WHERE)
        assert conv[1] == {"role": "assistant", "content": "", "tool_calls": [want_call]}
    # LLaMA-Factory's ShareGPT: function_call (the call's JSON) and observation
    sharegpt = [{"from": "human", "value": "What is 48/2?"},
                {"from": "function_call", "value": json.dumps(
                    {"name": "calculator", "arguments": {"expression": "48/2"}})},
                {"from": "observation", "value": "24"}, {"from": "gpt", "value": "It is 24."}]
    conv = normalise(sharegpt, None, WHERE)
    assert conv[1]["tool_calls"] == [want_call] and conv[2] == {"role": "tool", "content": "24"}
    # a result as an object is JSON; ids and names kept; parquet arrays read as lists
    row = _row(result={"value": 24}, tool_call_id="call_0")
    row[2]["name"] = "calculator"
    conv = normalise(np.array(row, dtype=object), None, WHERE)
    assert conv[2] == {"role": "tool", "content": '{"value": 24}', "tool_call_id": "call_0",
                       "name": "calculator"}
    assert conv[1]["tool_calls"][0]["id"] == "call_0"


def test_reasoning_is_reasoning_content_wherever_the_row_wrote_it():
    think = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "<think>\nhalf of 48\n</think>\n\nIt is 24."}]
    assert normalise(think, None, WHERE)[1] == {
        "role": "assistant", "content": "It is 24.", "reasoning_content": "half of 48"}
    given = [think[0], {"role": "assistant", "content": "It is 24.",
                        "reasoning_content": "half of 48"}]
    assert normalise(given, None, WHERE)[1]["reasoning_content"] == "half of 48"
    # a turn that only thinks, or only calls, has something to learn; an empty one not
    assert normalise([think[0], {"role": "assistant", "content": None,
                                 "reasoning_content": "hm"}], None, WHERE) is not None
    assert normalise([think[0], {"role": "assistant", "content": " "}], None, WHERE) is None


@pytest.mark.parametrize("value,message", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": "x"}],
     " message 1: tool_calls is not a list of calls"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"id": 1}]}],
     " message 1: tool call 0 has no function name"),
    ([{"role": "tool", "content": "1"}], ": message 0 is tool, expected user (user and "
     "assistant alternate from a user turn, tool results follow the assistant turn that "
     "called the tools; a system message only first)"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                          "reasoning_content": 3}],
     " message 1: reasoning_content is not a string"),
])
def test_a_malformed_turn_is_refused_in_one_line(value, message):
    with pytest.raises(PipelineError) as caught:
        normalise(value, None, WHERE)
    assert str(caught.value) == WHERE + message


def _ctx(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "data/models/stories260K")
    return DataContext(tmp_path, lambda: tok)


def _data(tmp_path, **keys):
    return DataConfig(json_file_path="x.jsonl", dataset_type="chat", chat_template=TEMPLATE,
                      **keys)


def _frame(rows, tools=None):
    frame = {"messages": [json.dumps(r) for r in rows]}
    if tools is not None:
        frame["tools"] = tools
    return pd.DataFrame(frame)


def _bad_rows():
    """Row 1: a result no call asked for; row 3: a call to an unlisted tool; row 5:
    arguments that are not JSON; the rest sound."""
    rows = [_row() for _ in range(8)]
    rows[1][1] = {"role": "assistant", "content": "Let me see."}
    rows[3][1]["tool_calls"] = [_call(name="search")]
    rows[5][1]["tool_calls"] = [_call(arguments="{expression: 48/2")]
    return rows


def test_unsound_tool_use_is_dropped_and_counted_by_rule(tmp_path):
    from tasks.format import format_split

    data = _data(tmp_path, tools=[CALC])
    rows, stats = format_split(data, _frame(_bad_rows()), "train", _ctx(tmp_path), 0.5)
    assert len(rows) == 5 and stats["dropped_rows"] == 3
    assert stats["dropped_by_reason"] == {"a tool result without a preceding call": 1,
                                          "a call to a tool missing from tools": 1,
                                          "call arguments that are not a JSON object": 1}
    kept = [json.loads(m) for m in rows["messages"]]
    assert kept[0][1]["tool_calls"][0]["function"]["arguments"] == {"expression": "48/2"}
    assert json.loads(rows["tools"][0]) == [CALC]
    # above the limit the stage fails naming the first row and its rule, in one line
    with pytest.raises(PipelineError) as caught:
        format_split(data, _frame(_bad_rows()), "train", _ctx(tmp_path), 0.2)
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("format split 'train': 3/8 rows have a tool result without a "
                           "preceding call (1); a call to a tool missing from tools (1); call "
                           "arguments that are not a JSON object (1) (first: row 1, a tool "
                           "result without a preceding call (message 2 answers no call))")
    assert line.endswith("above data.max_dropped_fraction 0.2: clean the data or raise "
                         "data.max_dropped_fraction")


def test_a_result_must_answer_a_call_of_the_turn_before_it(tmp_path):
    from finetune.datatypes.conversation import tool_contract_failures

    two = _row()
    two[1]["tool_calls"] = [_call(id="a"), _call(id="b")]
    two[2:3] = [{"role": "tool", "content": "24", "tool_call_id": "b"},
                {"role": "tool", "content": "24", "tool_call_id": "a"}]
    three = json.loads(json.dumps(two))
    three.insert(4, {"role": "tool", "content": "24"})  # a third result for two calls
    wrong_id = _row(tool_call_id="call_9")  # names an id no call has: answers the call
    convs = {i: normalise(r, None, WHERE) for i, r in enumerate((two, three, wrong_id))}
    tools = dict.fromkeys(convs, tool_schemas([CALC], "t"))
    assert tool_contract_failures(convs, tools) == {
        1: ("tool_result_answers_a_call", "message 4 answers no call")}
    # no tools offered at all: a call names a tool missing from them
    assert tool_contract_failures({0: convs[0]}, {0: []})[0][0] == "calls_a_listed_tool"


def test_tools_come_from_the_row_else_the_dataset(tmp_path):
    from tasks.format import format_split

    (tmp_path / "tools.json").write_text(json.dumps([CALC]))
    search = {"name": "search", "parameters": {}}
    rows = [_row(), _row(_call(name="search"))]
    data = _data(tmp_path, tools="tools.json")
    out, _ = format_split(data, _frame(rows, [None, json.dumps([search])]), "train",
                          _ctx(tmp_path), 0.0)
    assert [[t["function"]["name"] for t in json.loads(x)] for x in out["tools"]] == [
        ["calculator"], ["search"]]
    assert out["prompt"][1].startswith("Tools: search \nUser: What is 48/2?")
    with pytest.raises(PipelineError, match=r"^data.tools_field 'fns' is not a column of "
                       r"split 'train'"):
        format_split(_data(tmp_path, tools_field="fns"), _frame(rows), "train",
                     _ctx(tmp_path), 0.0)
    with pytest.raises(PipelineError, match=r"^data.tools: 'missing.json' is not a file"):
        format_split(_data(tmp_path, tools="missing.json"), _frame(rows), "train",
                     _ctx(tmp_path), 0.0)
    with pytest.raises(PipelineError, match=r"^split 'train' row 1 column 'tools': tool 0 has "
                       r"no name"):
        format_split(data, _frame(rows, [None, json.dumps([{"parameters": {}}])]), "train",
                     _ctx(tmp_path), 0.0)


def test_every_turn_that_calls_tools_is_an_evaluation_sample(tmp_path):
    from finetune.config.evaluation import EvalConfig
    from tasks.format import format_split

    data = _data(tmp_path, tools=[CALC])
    ends_on_call = _row()[:2]  # a conversation whose last turn is the call
    rows, _ = format_split(data, _frame([_row(), ends_on_call]), "test", _ctx(tmp_path), 0.0)
    datatype = data.datatype
    evaluated = datatype.eval_rows(rows)
    call = [{"name": "calculator", "arguments": {"expression": "48/2"}}]
    assert evaluated["reference"].tolist() == [call, "It is 24.", call]
    assert evaluated["prompt"][0] == "Tools: calculator \nUser: What is 48/2?\nAssistant: "
    assert evaluated["prompt"][1].endswith("Result: 24\nAssistant: ")
    predictions = ['Call: {"name": "calculator", "arguments": {"expression": "48/2"}}',
                   "It is 24.", 'Call: {"name": "calculator", "arguments": {"expression": "48"}}']
    ev = EvalConfig(generation_metrics=["exact_match", "tool_calls"])
    scores = datatype.score(predictions, evaluated["reference"].tolist(), ev, _ctx(tmp_path))
    assert scores == {"exact_match": 1.0, "tool_name_match": 1.0, "tool_arguments_match": 0.5}
    assert "tool_name_match" in datatype.reported_metrics()
    # without tool_calls asked for, the call samples are generated but not scored
    ev = EvalConfig(generation_metrics=["exact_match"])
    assert datatype.score(predictions, evaluated["reference"].tolist(), ev,
                          _ctx(tmp_path)) == {"exact_match": 1.0}


@pytest.mark.parametrize("text,calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
     [{"name": "f", "arguments": {"x": 1}}]),  # Qwen / Hermes
    ('{"name": "f", "parameters": {"x": 1}}', [{"name": "f", "arguments": {"x": 1}}]),  # Llama
    ('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]),  # Mistral
    ('{"type": "function", "function": {"name": "f", "arguments": "{\\"x\\": 1}"}}',
     [{"name": "f", "arguments": {"x": 1}}]),  # OpenAI's wire form
    ('Call: {"name": "f", "arguments": "not json"} {"answer": 3} {broken',
     [{"name": "f", "arguments": None}]),
    ("It is 24.", []),
])
def test_calls_are_read_from_any_template_s_text(text, calls):
    assert parse_tool_calls(text) == calls


def test_arguments_compare_as_parsed_json():
    want = [[{"name": "f", "arguments": {"a": 1, "b": "x"}}]]
    assert score_tool_calls(['{"name": "f", "arguments": {"b": "x", "a": 1}}'], want) == {
        "tool_name_match": 1.0, "tool_arguments_match": 1.0}
    assert score_tool_calls(['{"name": "f", "arguments": {"a": "1", "b": "x"}}'], want) == {
        "tool_name_match": 1.0, "tool_arguments_match": 0.0}
    assert score_tool_calls(['{"name": "g", "arguments": {"a": 1, "b": "x"}}'], want) == {
        "tool_name_match": 0.0, "tool_arguments_match": 0.0}


@pytest.mark.parametrize("keys,message", [
    ({"roles_to_train": ["assistant", "tool"]}, "roles_to_train.1"),
    ({"assistant_only_loss": False, "train_on_eos": False},
     "train_on_eos needs assistant_only_loss: true"),
    ({"last_turn_only": True, "roles_to_train": ["user", "assistant"]},
     "last_turn_only trains the last assistant turn alone"),
])
def test_the_knobs_refuse_what_cannot_hold(tmp_path, keys, message):
    with pytest.raises(ValueError, match=message):
        _data(tmp_path, **keys)


def test_preference_and_prompt_conversations_carry_tools_and_their_contracts(tmp_path):
    """The conversational forms of the preference and prompt types render with the row's
    tools, and a side or prompt whose tool use is unsound is dropped and counted."""
    ctx = _ctx(tmp_path)
    prompt = _row()[:3]  # the question, the call, its result: the model answers next
    good = [{"role": "assistant", "content": "It is 24."}]
    bad = [{"role": "assistant", "content": "", "tool_calls": [_call(name="search")]}]
    pairs = pd.DataFrame({"prompt": [prompt, prompt], "chosen": [good, good],
                          "rejected": [[{"role": "assistant", "content": "It is 2."}], bad]})
    data = DataConfig(json_file_path="x.jsonl", dataset_type="preference",
                      chat_template=TEMPLATE, tools=[CALC])
    formatted = data.datatype.format(pairs, "train", ctx)
    assert formatted.rows["prompt"][0].startswith("Tools: calculator \nUser: What is 48/2?")
    assert formatted.rows["prompt"][0].endswith("Result: 24\nAssistant: ")
    assert formatted.rows["completion"][0] == "It is 24.</s>\n"
    assert formatted.dropped == [1]
    assert formatted.reasons[1].startswith("a call to a tool missing from tools (message 3 "
                                           "calls 'search'; tools: calculator) in rejected")
    prompts = pd.DataFrame({"prompt": [prompt, [prompt[0], {"role": "tool", "content": "1"}]]})
    data = DataConfig(json_file_path="x.jsonl", dataset_type="prompt", chat_template=TEMPLATE,
                      tools=[CALC])
    formatted = data.datatype.format(prompts, "train", ctx)
    assert formatted.rows["prompt"][0].endswith("Result: 24\nAssistant: ")
    assert formatted.dropped == [1]
    assert formatted.reasons[1] == ("a tool result without a preceding call (message 1 "
                                    "answers no call)")
