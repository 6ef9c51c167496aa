"""GRPO with environments (grpo.environment_factory, TRL's GRPOTrainer environment_factory=)
through the stages: the format stage renders the environment's methods as the prompts' tools,
every rollout gets its own instance, reset with its row (reset's text appended to the prompt's
last user message), the model's calls run the instance's methods, the reward functions get the
instances as `environments=`, and an environment that owns its reward (`get_reward`) adds a
reward named after its class, in training and in the evaluate stage. The model is
test_grpo_tools' rigged Llama (it calls add(2, 3) whenever its context ends with the generation
prompt); everything else is the product's own path."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from helpers import copy_project, stages_here, train_in_place, write_params
from test_grpo_tools import CALL, RIGGED_GRPO, rigged_model

from finetune.errors import PipelineError

ENV = '''
import random


class Calculator:
    """A calculator whose running total is the rollout's state."""

    def __init__(self):
        self.total, self.ticket = 0, None

    def reset(self, **row):
        self.total, self.ticket = 0, row["ticket"]
        return f" [ticket {row['ticket']}]"

    def add(self, a: int, b: int) -> int:
        """Adds two integers and keeps the sum.

        Args:
            a: the first
            b: the second
        """
        self.total += a + b
        return a + b

    def get_reward(self) -> float:
        return float(self.total)


class Quiet(Calculator):
    def reset(self, **row):
        self.total = 0
        return None


class Dice(Calculator):
    """Draws from its own generator, seeded per rollout (reset's seed=)."""

    def reset(self, seed, **row):
        self.total, self.ticket, self.rng = 0, row["ticket"], random.Random(seed)
        return f" [roll {self.rng.randint(1, 1000)}]"

    def get_reward(self) -> float:
        return self.total + self.rng.random()


class NoReset:
    def add(self, a: int, b: int) -> int:
        """Adds.

        Args:
            a: the first
            b: the second
        """
        return a + b
'''
REWARD = '''
def tickets(completions, environments, ticket, **kwargs):
    """1 where the rollout's environment was reset with its own row (TRL's environments=)."""
    return [float(e.ticket == t) for e, t in zip(environments, ticket)]
'''


def _project(tmp_path: Path, factory, rows_env=None) -> Path:
    project = copy_project(tmp_path / "p", {
        **RIGGED_GRPO, "grpo.environment_factory": factory,
        "grpo.reward_funcs": ["preprocess/env_reward.py:tickets"],
        "grpo.num_generations_eval": 2, "training.per_device_eval_batch_size": 2,
        "eval.max_generation_samples": 2})
    rigged_model(project / "data/models/rigged")
    (project / "preprocess/calc_env.py").write_text(ENV)
    (project / "preprocess/env_reward.py").write_text(REWARD)
    source = project / "data/source/calc"
    source.mkdir(parents=True)
    for split, n in (("train", 4), ("test", 2)):
        (source / f"{split}.jsonl").write_text("".join(json.dumps({
            "prompt": [{"role": "user", "content": f"What is 2 + 3? ({i})"}],
            "ticket": f"{split}-{i}",
            **({"environment": rows_env[i % len(rows_env)]} if rows_env else {})}) + "\n"
            for i in range(n)))
    return project


def test_each_rollout_acts_in_its_own_environment_through_training_and_evaluation(
        tmp_path, monkeypatch):
    project = _project(tmp_path, "preprocess/calc_env.py:Calculator")
    stages_here(project, "download", "format", "tokenize")
    import pandas as pd

    formatted = pd.read_parquet(next((project / "data/formatted").rglob("train*.parquet")))
    assert '"name": "add"' in formatted["prompt"][0]  # the environment's method, rendered
    assert "Adds two integers and keeps the sum." in formatted["prompt"][0]

    train_in_place(project)
    with open(project / "data/plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    # every rollout: a call, its result, a call, its result, a call (2 rounds, the limit)
    assert [float(r["tools/call_frequency"]) for r in rows] == [2.0, 2.0]
    assert [float(r["tools/failure_frequency"]) for r in rows] == [0.0, 0.0]
    # get_reward: the instance's own total after its two calls ran (2 + 3, twice); none
    # leaks into another rollout (reset starts each at 0)
    assert [float(r["rewards/Calculator/mean"]) for r in rows] == [10.0, 10.0]
    # the reward function got each rollout's instance, reset with that rollout's row
    assert [float(r["rewards/tickets/mean"]) for r in rows] == [1.0, 1.0]
    samples = [json.loads(line) for line in
               (project / "data/plots/train_samples.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples:  # reset's text is in the prompt the rollout was generated from
        prompt = json.loads(sample["prompt"])
        assert prompt[-1]["content"].endswith("]") and "[ticket train-" in prompt[-1]["content"]
        assert sample["completion"].count(CALL) == 3, sample["completion"]
        assert (sample["tool_calls"], sample["tool_failures"]) == (2, 0)  # the third unrun

    stages_here(project, "evaluate")  # the held-out rollouts act in environments too
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    flat = json.dumps(metrics)
    assert "reward_Calculator" in flat and "reward_tickets" in flat, metrics
    found = [v for k, v in _leaves(metrics) if k.endswith("reward_Calculator")]
    assert found and all(v == 10.0 for v in found), metrics

    # the run's lineage names the files of the environment and the reward function it ran
    import hashlib

    from finetune.workspace import Workspace
    from tasks.tracking import lineage

    monkeypatch.chdir(project)
    traced = lineage(Workspace.load(project / "params/default.yaml"))
    for key, file in (("grpo.environment_factory", "calc_env.py"),
                      ("grpo.reward_funcs[0]", "env_reward.py")):
        expected = hashlib.sha256((project / "preprocess" / file).read_bytes()).hexdigest()
        assert traced[f"code_sha256.{key}"] == expected, key


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, tree


def test_a_mapping_chooses_each_rows_environment_and_refuses_an_unknown_one(tmp_path,
                                                                           monkeypatch):
    project = _project(tmp_path, {"loud": "preprocess/calc_env.py:Calculator",
                                  "quiet": "preprocess/calc_env.py:Quiet"},
                       rows_env=["loud", "quiet"])
    stages_here(project, "download", "format", "tokenize")
    train_in_place(project)
    samples = [json.loads(line) for line in
               (project / "data/plots/train_samples.jsonl").read_text().splitlines()]
    loud = [s for s in samples if "[ticket" in s["prompt"]]
    assert loud and len(loud) < len(samples)  # Quiet.reset appends nothing
    with open(project / "data/plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    # one reward column per class that owns one: Calculator and its subclass Quiet, each
    # scoring only its own rollouts (TRL's exact-type match)
    assert {"rewards/Calculator/mean", "rewards/Quiet/mean"} <= set(rows[0])

    source = project / "data/source/calc/train.jsonl"
    lines = source.read_text().splitlines()
    row = json.loads(lines[2])
    row["environment"] = "shouty"
    lines[2] = json.dumps(row)
    source.write_text("\n".join(lines) + "\n")
    says = ("split 'train' row 2 column 'environment': 'shouty' is none of "
            "grpo.environment_factory's environments (loud, quiet)")
    # at validate, before any stage runs (every row's column read; the rest of a row is not)
    from finetune.workspace import Workspace
    from tasks.checks import check_without_data

    with monkeypatch.context() as here:
        here.chdir(project)
        here.setattr(sys, "path", [str(project), *sys.path])
        with pytest.raises(PipelineError) as refused:  # the CLI makes it one line, exit 2
            check_without_data(Workspace.load(project / "params/default.yaml"))
    assert says in str(refused.value)
    stages_here(project, "download")  # and in the format stage (where validate cannot read
    with pytest.raises(PipelineError) as refused:  # a hub dataset's rows)
        stages_here(project, "format")
    assert says in str(refused.value)


def test_validate_names_an_environment_that_cannot_be_one(tmp_path, monkeypatch):
    """`finetune validate` through the CLI's own main (tests/test_cli.py covers the process's
    exit): exit 2 and one line naming the entry."""
    import contextlib
    import io
    import sys

    from flows import cli

    project = _project(tmp_path, "preprocess/calc_env.py:NoReset", rows_env=["a"])
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for factory, says in [
        ("preprocess/calc_env.py:NoReset", "grpo.environment_factory: NoReset is not an "
         "environment: it defines no reset(**row) method"),
        ("preprocess/calc_env.py:Nowhere", "grpo.environment_factory"),
        ({"a": "preprocess/calc_env.py:Calculator", "b": "preprocess/calc_env.py:NoReset"},
         "grpo.environment_factory.b: NoReset is not an environment"),
        (None, "params/default.yaml: grpo: reward_funcs is empty and there is no "
         "environment_factory"),
    ]:
        write_params(project, {"grpo.environment_factory": factory,
                               **({} if factory else {"grpo.reward_funcs": []})})
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["validate"])
        errors = [ln for ln in err.getvalue().splitlines() if ln.startswith("error: ")]
        assert code == 2 and len(errors) == 1, (code, err.getvalue())
        assert errors[0].startswith(f"error: {says}"), errors[0]


#: a seeded environment's run, with LoRA (the comparisons read the adapter) and checkpoints
DICE = {"grpo.environment_factory": "preprocess/calc_env.py:Dice", "peft.use_peft": True,
        "grpo.reward_funcs": [],  # the environment owns the reward (TRL allows none besides)
        "training.max_steps": 4, "checkpoint.save_strategy": "steps",
        "checkpoint.save_steps": 2}


def _samples(project: Path) -> list[dict]:
    return [json.loads(line) for line in
            (project / "data/plots/train_samples.jsonl").read_text().splitlines()]


def _rolls(project: Path) -> list[str]:
    return [json.loads(s["prompt"])[-1]["content"].rsplit("[roll ", 1)[1] for s in
            _samples(project)]


@pytest.fixture(scope="module")
def dice(tmp_path_factory) -> Path:
    """A tokenized project of the seeded environment (reset(seed, **row): its observation
    and its reward are draws from random.Random(seed))."""
    project = _project(tmp_path_factory.mktemp("dice"), DICE["grpo.environment_factory"])
    write_params(project, DICE)
    stages_here(project, "download", "format", "tokenize")
    return project


def test_a_seeded_environment_run_resumes_bitwise_with_its_samples(dice, tmp_path):
    """Each rollout's environment gets a seed of (seed, step, the row's global position, the
    rollout's index in its group): the rolls differ between rollouts and steps, and a run
    cut back to what a SIGKILL right after its step-2 checkpoint leaves resumes to the same
    weights bitwise, the same logged rows and the same samples table, the environments
    reseeded as in the uninterrupted run."""
    from helpers import resume_cut_back, train_here, train_in_place

    full, _ = train_here(dice, tmp_path / "full")
    rolls = _rolls(full)
    assert len(rolls) == 4 * 2 * 2 and len(set(rolls)) == len(rolls), rolls
    with open(full / "data/plots/train.csv") as fh:
        rewards = [float(r["rewards/Dice/mean"]) for r in csv.DictReader(fh)]
    assert len(set(rewards)) == len(rewards)  # the draws reach the reward
    resume_cut_back(full, tmp_path, 2, train_in_place)
    assert _samples(tmp_path / "cut") == _samples(full)


@pytest.mark.distributed
def test_two_processes_equal_one_with_seeded_environments(dice, tmp_path):
    """One process x 4 prompts equals DDP on 2 torchrun processes (gloo) x 2 prompts: each
    rollout's environment is seeded by its row's position in the step's global batch, not by
    rank, so the rolls, the rewards and the samples table are the same, and the weights agree
    to the summation order."""
    from helpers import adapter, assert_weights_close, train_copy, train_here

    params = {"training.max_steps": 2, "checkpoint.save_strategy": "no"}
    one, _ = train_here(dice, tmp_path / "one", {**params,
                                                 "training.per_device_train_batch_size": 4})
    two, _ = train_copy(dice, tmp_path / "two", {
        **params, "distributed.strategy": "ddp", "distributed.nproc_per_node": 2,
        "training.per_device_train_batch_size": 2})
    assert _samples(two) == _samples(one)
    for name in ("rewards/Dice/mean", "reward", "loss"):
        assert _column(two, name) == pytest.approx(_column(one, name), rel=1e-5, abs=1e-6)
    assert_weights_close(adapter(two), adapter(one))


def _column(project: Path, name: str) -> list[float]:
    with open(project / "data/plots/train.csv") as fh:
        return [float(r[name]) for r in csv.DictReader(fh)]
