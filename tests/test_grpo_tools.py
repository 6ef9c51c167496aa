"""GRPO with tools (grpo.tools, TRL's GRPOTrainer tools=) through the stages: the format stage
renders the tools' schemas into the prompts, and a run's completions are episodes in which the
model's calls run and their results come back before it continues, with TRL's tool statistics
logged. The model is a real Llama whose weights are set so that it writes a fixed tool call
after the generation prompt and ends its turn after it (a model that calls tools without
training one); everything else is the product's own path."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch
from conftest import chat_bpe_tokenizer
from helpers import copy_project, error_line, run_cli, stages_here, train_in_place

TEMPLATE = Path(__file__).parent / "templates/qwen2.5-tools.jinja"
#: what the model writes whenever its context ends with the generation prompt
CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
CALC = '''
def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''


def rigged_model(dest: Path):
    """A one-layer Llama whose attention and MLP write nothing (their output projections are
    zero), so each next token depends on the current token alone: after the last token of the
    generation prompt it is CALL (one added token), after any other token the end of turn."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = chat_bpe_tokenizer()
    tok.add_tokens([CALL])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = TEMPLATE.read_text()
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    trigger, call, eos = prompt[-1], tok.convert_tokens_to_ids(CALL), tok.eos_token_id
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=eos, pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        u, v = torch.eye(16)[0], torch.eye(16)[1]
        model.model.embed_tokens.weight.copy_(v.expand(len(tok), 16))
        model.model.embed_tokens.weight[trigger] = u
        model.lm_head.weight.zero_()
        model.lm_head.weight[call] = 40 * u
        model.lm_head.weight[eos] = 40 * v
    model.generation_config.eos_token_id = eos
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return tok


#: a two-step GRPO run of the rigged model on data/source/calc (conversational prompts), two
#: rounds of tool calls at most; tests/test_grpo_environments.py runs it too
RIGGED_GRPO = {
    "model.name_or_path": "data/models/rigged", "model.dtype": "float32",
    "peft.use_peft": False, "training.type": "grpo", "data.dataset_type": "prompt",
    "data.data_files": {"train": "data/source/calc/train.jsonl",
                        "test": "data/source/calc/test.jsonl"},
    "data.prompt_template": None, "data.completion_template": None,
    "data.max_train_samples": 4, "data.max_eval_samples": 2, "data.max_seq_length": 1024,
    "grpo.max_tool_calling_iterations": 2,
    "grpo.num_generations": 2, "grpo.max_completion_length": 64,
    "training.max_steps": 2, "training.per_device_train_batch_size": 2,
    "logging.logging_steps": 1, "eval.eval_strategy": "no",
    "checkpoint.save_strategy": "no", "registry.gate_metric": "eval.reward"}


def test_a_run_with_tools_calls_them_between_turns_and_logs_trls_statistics(tmp_path):
    project = copy_project(tmp_path / "p", {
        **RIGGED_GRPO, "grpo.tools": ["preprocess/calc.py:add"],
        "grpo.reward_funcs": ["format"], "grpo.format_regex": "5"})
    tok = rigged_model(project / "data/models/rigged")
    (project / "preprocess/calc.py").write_text(CALC)
    source = project / "data/source/calc"
    source.mkdir(parents=True)
    for split, n in (("train", 4), ("test", 2)):
        (source / f"{split}.jsonl").write_text("".join(json.dumps({
            "prompt": [{"role": "user", "content": f"What is 2 + 3? ({i})"}], "answer": "5"})
            + "\n" for i in range(n)))
    stages_here(project, "download", "format", "tokenize")
    formatted = next((project / "data/formatted").rglob("*.parquet"))
    import pandas as pd

    prompt = pd.read_parquet(formatted)["prompt"][0]
    assert '"name": "add"' in prompt and "Adds two integers." in prompt  # the schema, rendered

    train_in_place(project)
    with open(project / "data/plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    # every completion: a call, its result, a call, its result, a call (the limit: 2 rounds)
    assert [float(r["tools/call_frequency"]) for r in rows] == [2.0, 2.0]
    assert [float(r["tools/failure_frequency"]) for r in rows] == [0.0, 0.0]
    samples = [json.loads(line) for line in
               (project / "data/plots/train_samples.jsonl").read_text().splitlines()]
    result = "<tool_response>\n5\n</tool_response>"
    assert samples and all(s["completion"].count(CALL) == 3 and s["completion"].count(result)
                           == 2 for s in samples), samples[0]["completion"]
    assert tok.convert_tokens_to_ids(CALL) != tok.unk_token_id

    # a function the chat template cannot describe is one line naming its entry, before any
    (project / "preprocess/bad.py").write_text("def mul(a, b):\n    return a * b\n")
    proc = run_cli(project, "validate", "-s", "grpo.tools=[preprocess/calc.py:add,"
                   "preprocess/bad.py:mul]")
    assert error_line(proc).startswith("error: grpo.tools[1]: mul cannot be a tool: "), proc
