"""Multi-turn tool rollouts (engine.rollout.multi_turn): the tool results' tokens against TRL's
own `_get_tool_suffix_ids` on the templates of tests/templates, and the loop's episodes, masks,
limits, counts and seeds over a scripted inner generator (the `Generator` seam: what the model
writes is fixed by the test, so every token of an episode is known)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import chat_bpe_tokenizer

from engine.rollout.generator import Completions
from engine.rollout.multi_turn import ToolLoop, tool_suffix_ids, turn_seed
from engine.rollout.tools import ToolRunner
from finetune.errors import PipelineError

TEMPLATES = Path(__file__).parent / "templates"
#: each template's end of a generated turn (the tokenizer's EOS while it renders)
EOS = {"qwen2.5-tools": "<|im_end|>", "llama3.1-tools": "<|eot_id|>",
       "qwen3-reasoning": "<|im_end|>"}


def tokenizer(name: str):
    tok = chat_bpe_tokenizer()  # a fresh one: the EOS and template are set on it
    tok.eos_token = EOS[name]
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


@pytest.mark.parametrize("name", sorted(EOS))
@pytest.mark.parametrize("results", [
    [("add", "5")],
    [("get_weather", '{"city": "Paris", "temp_c": 21}'), ("add", "{'error': 'Tool x not found.'}")],
])
def test_tool_results_are_the_tokens_trl_appends(name, results):
    from trl import GRPOTrainer

    tok = tokenizer(name)
    messages = [{"role": "tool", "name": n, "content": c} for n, c in results]
    trl_self = types.SimpleNamespace(processing_class=tok, _tokenizer=tok, chat_template=None,
                                     chat_template_kwargs={}, _is_vlm=False)
    try:
        expected = GRPOTrainer._get_tool_suffix_ids(trl_self, messages)
    except ValueError:  # a template that rewrites earlier turns: both refuse it
        with pytest.raises(PipelineError, match="changes the turns before them"):
            tool_suffix_ids(tok, messages)
        return
    assert tool_suffix_ids(tok, messages) == expected
    text = tok.decode(expected)
    user = [{"role": "user", "content": "hi"}]
    with_prompt, without = (tok.apply_chat_template(user, tokenize=False, add_generation_prompt=g)
                            for g in (True, False))
    assert all(content in text for _, content in results)
    assert text.endswith(with_prompt[len(without):])  # ready for the model's next turn


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def echo(text: str) -> str:
    """Returns its text.

    Args:
        text: what comes back
    """
    return text


CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'


class Scripted:
    """A `Generator` whose completions the test fixes: row text = script(context text, turn),
    where the turn is how many tool results the context holds; every call's seeds are kept."""

    def __init__(self, tok, script, max_tokens: int = 400):
        self.tok, self.script, self.max_tokens = tok, script, max_tokens
        self.seeds: list = []

    def generate(self, prompt_ids, prompt_mask, num_generations, seed) -> Completions:
        self.seeds.append(seed)
        rows = []
        for ids, mask in zip(prompt_ids, prompt_mask):
            context = self.tok.decode(ids[mask.bool()].tolist())
            turn = context.count("<|im_start|>user\n<tool_response>")
            for j in range(num_generations):
                text = self.script(context, turn, j)
                rows.append(self.tok(text, add_special_tokens=False)["input_ids"][:self.max_tokens])
        eos = self.tok.eos_token_id
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tok.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        clipped = torch.tensor([eos not in r for r in rows])
        return Completions(ids, mask, mask.sum(1), clipped)


def prompts(tok, questions: list[str]):
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in questions]
    encoded = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    from engine.rollout.generator import left_pad

    return left_pad(encoded, tok.pad_token_id)


def run(tok, script, questions, *, num_generations=2, max_iterations=None, length=200,
        tools=None, seeds=(11, 12), max_positions=None):
    inner = Scripted(tok, script)
    loop = ToolLoop(inner, tok, max_iterations, length, max_positions)
    ids, mask = prompts(tok, questions)
    runners = [ToolRunner(tools or {"add": add}) for _ in range(len(questions) * num_generations)]
    done = loop.generate(ids, mask, num_generations, list(seeds[:len(questions)]), runners)
    return loop, inner, done


def pieces(tok, done, row):
    n = int(done.lengths[row])
    ids, trained = done.ids[row, :n].tolist(), done.trained[row, :n].tolist()
    spans, start = [], 0
    for k in range(1, n + 1):
        if k == n or trained[k] != trained[start]:
            spans.append((trained[start], tok.decode(ids[start:k])))
            start = k
    return spans


def test_an_episode_is_the_turns_and_the_tool_results_between_them_untrained():
    tok = tokenizer("qwen2.5-tools")

    def script(context, turn, j):
        return f"{CALL}<|im_end|>" if turn == 0 else "It is 5.<|im_end|>"

    loop, inner, done = run(tok, script, ["What is 2 + 3?"], num_generations=2)
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}])
    for row in range(2):
        assert pieces(tok, done, row) == [(1, f"{CALL}<|im_end|>"), (0, tok.decode(suffix)),
                                          (1, "It is 5.<|im_end|>")]
    assert done.mask.sum().item() == done.lengths.sum().item() and not done.clipped.any()
    assert done.tool_calls.tolist() == [1, 1] and done.tool_failures.tolist() == [0, 0]
    # the second turn: one completion per row, each row seeded by its prompt, index and turn
    assert inner.seeds == [[11], [turn_seed(11, 0, 1), turn_seed(11, 1, 1)]]


def test_calls_stop_at_the_iteration_limit_and_failures_are_counted():
    tok = tokenizer("qwen2.5-tools")
    bad = '{"name": "nope", "arguments": {}}'

    def script(context, turn, j):  # never stops calling; the second prompt's tool is unknown
        return f"{bad if 'Fail' in context else CALL}<|im_end|>"

    loop, inner, done = run(tok, script, ["Add.", "Fail."], num_generations=1, max_iterations=2)
    for row in range(2):
        assert [p[0] for p in pieces(tok, done, row)] == [1, 0, 1, 0, 1]  # 3 turns, 2 results
    assert len(inner.seeds) == 3
    assert "Tool nope not found." in pieces(tok, done, 1)[1][1]
    assert done.tool_calls.tolist() == [2, 2] and done.tool_failures.tolist() == [0, 2]


def test_results_that_would_pass_the_length_end_the_episode_as_it_was():
    tok = tokenizer("qwen2.5-tools")
    call = '{"name": "echo", "arguments": {"text": "' + "Paris " * 60 + '"}}'

    def script(context, turn, j):
        return f"{call if j == 0 else CALL}<|im_end|>" if turn == 0 else "Done.<|im_end|>"

    first = len(tok(f"{call}<|im_end|>", add_special_tokens=False)["input_ids"])
    loop, _, done = run(tok, script, ["Echo."], length=first + 40,
                        tools={"echo": echo, "add": add})
    assert pieces(tok, done, 0) == [(1, f"{call}<|im_end|>")]  # rolled back, not cut
    assert [p[0] for p in pieces(tok, done, 1)] == [1, 0, 1]
    assert done.tool_calls.tolist() == [1, 1]  # the dropped result's call ran: TRL counts it


def test_the_last_turn_is_cut_to_the_length_left_and_counts_as_clipped():
    tok = tokenizer("qwen2.5-tools")

    def script(context, turn, j):
        return f"{CALL}<|im_end|>" if turn == 0 else "The sum " * 30 + "<|im_end|>"

    short = run(tok, script, ["Add."], num_generations=1)[2]
    room = int(short.lengths[0]) - 10
    done = run(tok, script, ["Add."], num_generations=1, length=room)[2]
    assert int(done.lengths[0]) == room and bool(done.clipped[0])
    assert done.ids[0, :room].tolist() == short.ids[0, :room].tolist()


def test_an_episode_does_not_depend_on_the_other_prompts_of_the_batch():
    tok = tokenizer("qwen2.5-tools")

    def script(context, turn, j):
        return f"{CALL}<|im_end|>" if turn == 0 else f"{len(context)} {j}<|im_end|>"

    alone = run(tok, script, ["What is 2 + 3?"], seeds=(11,))
    together = run(tok, script, ["A much longer question about 2 + 3?", "What is 2 + 3?"],
                   seeds=(12, 11))
    for j in range(2):
        n = int(alone[2].lengths[j])
        assert together[2].ids[2 + j, :n].tolist() == alone[2].ids[j, :n].tolist()
    assert together[1].seeds[1][2:] == alone[1].seeds[1]


def test_a_wrong_number_of_runners_is_refused():
    tok = tokenizer("qwen2.5-tools")
    loop = ToolLoop(Scripted(tok, lambda c, t, j: "x<|im_end|>"), tok, None, 50)
    ids, mask = prompts(tok, ["Hi"])
    with pytest.raises(ValueError, match="1 tool runners for 2 completions"):
        loop.generate(ids, mask, 2, 0, [ToolRunner({})])
    assert json.dumps(turn_seed(2**62, 3, 1)) and turn_seed(1, 0, 1) != turn_seed(1, 1, 1)
