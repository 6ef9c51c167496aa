"""Our multi-turn tool rollout (engine.rollout.multi_turn.ToolLoop around
engine.rollout.local.LocalGenerator) held equal to TRL 1.16's own: GRPOTrainer(tools=[add]) runs
`_generate_and_score_completions` on the same prompts (its `_generate`, `_generate_single_turn`,
`_tool_call_loop` and `_get_tool_suffix_ids`, unpatched; the test only records what `_generate`
and `_tool_call_loop` return), and each completion's token ids, its tool mask and the number of
tool calls must be ours, token for token.

The model is tests/test_grpo_tools.py's rigged one-layer Llama: after the generation prompt's
last token it writes one added token holding a whole call of add(2, 3), after any other token
it ends its turn, so each episode is a call, its result, a call, its result and a third call,
left unrun at max_tool_calling_iterations=2.

How TRL reads the calls: GRPOTrainer parses a completion with the tokenizer's
`response_template` (transformers >= 5.13: `parse_response`). Its `__init__` sets one with
trl.chat_template_utils.add_response_schema only for the chat templates TRL ships and refuses
any other ("Unrecognized chat template, failed to add response schema. Please manually set the
response schema on the tokenizer or processor."), tests/templates/qwen2.5-tools.jinja included;
it keeps one already set. So each case sets `tokenizer.response_template` first:

- "qwen": the model writes Qwen's form, `<tool_call>\\n{...}\\n</tool_call>`, and the template is
  trl.chat_template_utils.qwen3_template, the one add_response_schema sets for TRL's own
  Qwen2.5 (and Qwen3) templates;
- "bare": the model writes test_grpo_tools.CALL, the bare JSON object (the product's own e2e
  model), and the template is BARE below, TRL's llama3_template (Llama 3.1's bare JSON call)
  with Qwen's "arguments" key and end of turn. Under qwen3_template TRL reads no call in it (the
  completion is content: `[CALL, <|im_end|>]`, no tool run) while our template-free parser
  (finetune.datatypes.tool_calls) runs it: the parsers differ there, by design, and this case
  holds the loops equal once both read the same calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import test_grpo_tools
from test_grpo_tools import CALL

NUM_GENERATIONS, MAX_ITERATIONS, MAX_LENGTH = 2, 2, 64
QWEN_CALL = f"<tool_call>\n{CALL}\n</tool_call>"
RESULT = "<tool_response>\n5\n</tool_response>"

#: a response template for the bare form (see the module docstring)
BARE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"arguments":\s*',
            "close_pattern": r"\}<\|im_end\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function",
                          "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def zero(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def trls_rollout(model_dir: Path, tok, prompts: list[list[dict]], out: Path) -> dict:
    """GRPOTrainer(tools=[add]) on the CPU generating for `prompts`, each repeated
    NUM_GENERATIONS times as its RepeatSampler hands them: what its `_generate` returned and
    the total calls `_tool_call_loop` counted."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, use_vllm=False,
                      num_generations=NUM_GENERATIONS, max_completion_length=MAX_LENGTH,
                      max_tool_calling_iterations=MAX_ITERATIONS,
                      per_device_train_batch_size=NUM_GENERATIONS, report_to="none")
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                          reward_funcs=zero, args=args, processing_class=tok, tools=[add],
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    seen: dict = {}

    def recording(name):
        method = getattr(trainer, name)

        def record(*a, **k):
            seen[name] = method(*a, **k)
            return seen[name]
        return record

    for name in ("_generate", "_tool_call_loop"):
        setattr(trainer, name, recording(name))
    torch.manual_seed(0)
    trainer._generate_and_score_completions(
        [{"prompt": p} for p in prompts for _ in range(NUM_GENERATIONS)])
    prompt_ids, completion_ids, tool_mask, completions = seen["_generate"][:4]
    calls, failures = seen["_tool_call_loop"][4:6]
    return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completion_ids,
            "tool_mask": tool_mask, "completions": completions, "calls": calls,
            "failures": failures}


def our_rollout(model_dir: Path, tok, prompts: list[list[dict]]):
    """ToolLoop(LocalGenerator) on the prompts as our format stage renders them (the tools'
    get_json_schema schemas) and the tokenize stage encodes the text."""
    from transformers import AutoModelForCausalLM

    from engine.rollout.generator import left_pad
    from engine.rollout.local import LocalGenerator, eos_ids
    from engine.rollout.multi_turn import ToolLoop
    from engine.rollout.sampling import SamplingParams
    from engine.rollout.tools import ToolRunner, tool_schema

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    schemas = [tool_schema(add, "tools[0]")]
    texts = [tok.apply_chat_template(p, tools=schemas, tokenize=False, add_generation_prompt=True)
             for p in prompts]
    encoded = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    generator = LocalGenerator(model, SamplingParams(max_completion_length=MAX_LENGTH),
                               eos_ids(tok, model), tok.pad_token_id)
    loop = ToolLoop(generator, tok, MAX_ITERATIONS, MAX_LENGTH,
                    model.config.max_position_embeddings, runner=ToolRunner({"add": add}))
    ids, mask = left_pad(encoded, tok.pad_token_id)
    return encoded, loop.generate(ids, mask, NUM_GENERATIONS, [11, 12])


@pytest.mark.parametrize("form", ["qwen", "bare"])
def test_tool_episodes_are_trls_token_for_token(tmp_path, monkeypatch, form):
    from trl.chat_template_utils import qwen3_template

    call = QWEN_CALL if form == "qwen" else CALL
    monkeypatch.setattr(test_grpo_tools, "CALL", call)  # rigged_model reads it when called
    tok = test_grpo_tools.rigged_model(tmp_path / "model")
    tok.response_template = qwen3_template if form == "qwen" else BARE
    prompts = [[{"role": "user", "content": f"What is 2 + 3? ({i})"}] for i in range(2)]

    trl = trls_rollout(tmp_path / "model", tok, prompts, tmp_path / "trl")
    encoded, done = our_rollout(tmp_path / "model", tok, prompts)

    rows = len(prompts) * NUM_GENERATIONS
    assert trl["prompt_ids"] == [encoded[i // NUM_GENERATIONS] for i in range(rows)]
    ours = [done.ids[i, :int(done.lengths[i])].tolist() for i in range(rows)]
    trained = [done.trained[i, :int(done.lengths[i])].tolist() for i in range(rows)]
    for i in range(rows):
        assert ours[i] == trl["completion_ids"][i], (i, tok.decode(ours[i]),
                                                     tok.decode(trl["completion_ids"][i]))
        assert trained[i] == trl["tool_mask"][i], i
    assert int(done.tool_calls.sum()) == trl["calls"] == rows * MAX_ITERATIONS
    assert int(done.tool_failures.sum()) == trl["failures"] == 0
    assert not done.clipped.any()

    # what the episodes are: 3 calls and 2 results, each result untrained and nothing else
    call_id = tok.convert_tokens_to_ids(call)
    for i in range(rows):
        ids, mask = ours[i], trained[i]
        assert ids.count(call_id) == 3 and tok.decode(ids).count(RESULT) == 2, tok.decode(ids)
        untrained = [t for t, m in zip(ids, mask) if not m]
        assert call_id not in untrained and tok.decode(untrained).count(RESULT) == 2
        assert [m["role"] for m in trl["completions"][i]] == ["assistant", "tool"] * 2 + [
            "assistant"]
