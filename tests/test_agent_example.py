"""The calculator agent example (params/agent-sft-gsm8k.yaml, then params/agent-gsm8k.yaml):
its shipped data is what preprocess/gsm8k_agent.py makes, its environment's tool is the
tool-calling example's schema and computes GSM8K's results without running model-written code,
and the GRPO file runs its stages with the environment (shrunk, on the shipped stories260K
instead of the SFT's model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT

AGENT = ROOT / "data/source/gsm8k-agent"


def test_the_shipped_tasks_are_what_the_script_makes(tmp_path):
    from preprocess.gsm8k_agent import main

    main(["--source", str(ROOT / "data/source/gsm8k"), "--out", str(tmp_path)])
    for name in ("sft.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (AGENT / name).read_bytes(), name
    sft = [json.loads(line) for line in (AGENT / "sft.jsonl").open()]
    train = [json.loads(line) for line in (AGENT / "train.jsonl").open()]
    asked = [row["messages"][0]["content"] for row in sft] + [
        row["prompt"][0]["content"] for row in train]
    assert len(asked) == len(set(asked)) == 1024 + 512  # no task twice, none in both


def test_the_calculator_is_the_examples_tool_and_computes_gsm8ks_results():
    from engine.rollout.environment import tool_methods
    from engine.rollout.tools import tool_schema
    from preprocess.calculator_env import Calculator

    env = Calculator()
    tools = tool_methods(env)
    assert list(tools) == ["calculator"]
    schema = tool_schema(tools["calculator"], "calculator")
    schema["function"].pop("return")
    shipped = json.loads((ROOT / "data/source/gsm8k-tools/tools.json").read_text())
    assert [schema] == shipped  # the prompts offer what the SFT trained on
    env.reset(prompt=[], answer="#### 1")
    for row in map(json.loads, (AGENT / "test.jsonl").open()):
        expression = row["prompt"][0]["content"].removeprefix("Compute ").removesuffix(".")
        assert "#### " + env.calculator(expression) == row["answer"], expression
    for bad in ("__import__('os').system('true')", "2**64", "x + 1", "1/0", "48/"):
        with pytest.raises(Exception):
            env.calculator(bad)
    assert (env.calls, env.failures) == (64 + 5, 5)
    env.reset()
    assert (env.calls, env.failures) == (0, 0)


def test_the_agent_runs_its_stages_in_the_calculator_environment(tmp_path):
    """Format renders the environment's tool as the SFT file renders tools.json; training and
    the held-out evaluation run the rollouts in the environment (tool statistics logged)."""
    import csv

    import pandas as pd
    from helpers import ON_STORIES, prepared_example, stages_here, train_in_place

    project = prepared_example(tmp_path / "p", "params/agent-gsm8k.yaml", {
        "data.max_train_samples": 8, "data.max_eval_samples": 4, "training.max_steps": 2,
        "training.per_device_train_batch_size": 2, "grpo.num_generations": 2,
        "grpo.max_completion_length": 48, "logging.logging_steps": 1,
        "checkpoint.save_strategy": "no", "grpo.num_generations_eval": 2,
        "eval.max_generation_samples": 4, "eval.generation_max_new_tokens": 48}, *ON_STORIES)
    prompt = pd.read_parquet(project / "data/formatted/train.parquet")["prompt"][0]
    shipped = json.loads((ROOT / "data/source/gsm8k-tools/tools.json").read_text())[0]
    function = shipped["function"]
    line = json.dumps({"name": function["name"],
                       "arguments": function["parameters"]["properties"]})
    assert prompt.startswith(f"Tools: {line}\nUser: Compute "), prompt
    train_in_place(project)
    with open(project / "data/plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and all("tools/call_frequency" in r for r in rows)
    stages_here(project, "evaluate")
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    assert {"reward_correctness", "reward_format"} <= set(metrics["finetuned"]), metrics
