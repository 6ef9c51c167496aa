"""Reward models (training.type reward on preference pairs): the Bradley-Terry loss and the
logged statistics against TRL's RewardTrainer (the oracle), the pairs' margin column as the
preference type carries it, and the run's guarantees (DDP, resume) and the example through
the stages: a trained reward model ranks held-out pairs better than the untrained one, and
its export loads as a one-output AutoModelForSequenceClassification."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT
from test_preference import CHAT_ROWS, CHAT_TEMPLATE, MODEL, STRING_ROWS, _tokenizer

MARGINS = [0.5, 0.0, 1.25]


def _encode(rows: list[dict], chat: bool) -> list[dict]:
    """The rows as the preference type formats and tokenizes them (margin included when the
    rows have one)."""
    from finetune.config.data import DataConfig
    from finetune.datatypes import DataContext

    data = DataConfig(dataset_type="preference", data_files={"train": "x.jsonl"},
                      chat_template=CHAT_TEMPLATE if chat else None)
    tok = _tokenizer()
    ctx = DataContext(ROOT, lambda: tok)
    formatted = data.datatype.format(pd.DataFrame(rows), "train", ctx)
    assert formatted.dropped == []
    fn, kwargs = data.datatype.encoder(ctx)
    enc = fn(formatted.rows.to_dict("list"), tok=tok, **kwargs)
    keys = [k for k in ("input_ids", "labels", "rejected_input_ids", "rejected_labels",
                        "margin") if k in enc]
    return [dict(zip(keys, values)) for values in zip(*(enc[k] for k in keys))]


def _reward_model():
    """stories260K with a one-output head (seeded: the head is newly initialised)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        MODEL, num_labels=1, dtype=torch.float32, pad_token_id=_tokenizer().pad_token_id)
    return model.train()  # as both trainers run it (no dropout in this model)


def _ours(model, pairs: list[dict], coefficient) -> tuple[float, dict]:
    from engine.datapath.data import collate
    from engine.recipe.reward.batches import collate_rewarded
    from engine.recipe.reward.loss import LOGGED, bradley_terry

    batch = collate_rewarded(pairs, lambda sides: collate(sides, _tokenizer().pad_token_id))
    rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out = bradley_terry(rewards, batch.get("margin"), coefficient)
    return float(out.losses.mean().detach()), {k: float(v) / len(pairs)
                                      for k, v in zip(LOGGED, out.sums())}


def _trls(tmp_path, model, pairs: list[dict], coefficient) -> tuple[float, dict]:
    """TRL's RewardTrainer.compute_loss on the same token ids, collated by its collator."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                        bf16=False, per_device_train_batch_size=len(pairs),
                        center_rewards_coefficient=coefficient)
    rows = [{"chosen_ids": p["input_ids"], "rejected_ids": p["rejected_input_ids"],
             **({"margin": p["margin"]} if "margin" in p else {})} for p in pairs]
    trainer = RewardTrainer(model=model, args=args, processing_class=_tokenizer(),
                            train_dataset=Dataset.from_list(rows))
    model.train()
    loss = trainer.compute_loss(model, trainer.data_collator(rows))
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("coefficient", [None, 0.1], ids=["plain", "centred"])
@pytest.mark.parametrize("margin", [False, True], ids=["no-margin", "margin"])
@pytest.mark.parametrize("chat", [False, True], ids=["strings", "conversational"])
def test_loss_and_statistics_equal_trls(tmp_path, chat, margin, coefficient):
    rows = CHAT_ROWS if chat else STRING_ROWS
    if margin:
        rows = [{**r, "margin": m} for r, m in zip(rows, MARGINS)]
    pairs = _encode(rows, chat)
    assert ("margin" in pairs[0]) == margin
    model = _reward_model()
    ours, stats = _ours(model, pairs, coefficient)
    theirs, trl_stats = _trls(tmp_path, model, pairs, coefficient)
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    for name in ("accuracy", "margin", "mean_reward"):  # TRL's names and means
        assert abs(stats[name] - trl_stats[name]) < 1e-5, name
    # each side's mean: TRL logs their mean (mean_reward) and difference (margin)
    assert abs(stats["rewards/chosen"] - stats["rewards/rejected"] - trl_stats["margin"]) < 1e-5
    assert abs((stats["rewards/chosen"] + stats["rewards/rejected"]) / 2
               - trl_stats["mean_reward"]) < 1e-5
    assert 0 < stats["accuracy"] < 1 or margin  # the untrained head ranks some pairs wrong


def test_the_margin_column_follows_its_pair_and_a_bad_one_is_one_line():
    """A dropped pair takes its margin with it; a missing margin is 0; a margin that is not a
    number stops the format stage naming the row and column."""
    from finetune.config.data import DataConfig
    from finetune.datatypes import DataContext
    from finetune.errors import PipelineError

    data = DataConfig(dataset_type="preference", data_files={"train": "x.jsonl"})
    ctx = DataContext(ROOT, _tokenizer)
    rows = [{**STRING_ROWS[0], "margin": 2.0}, {"prompt": "Q", "chosen": " same",
                                                "rejected": " same", "margin": 9.0},
            {**STRING_ROWS[1], "margin": None}, {**STRING_ROWS[2], "margin": 3}]
    out = data.datatype.format(pd.DataFrame(rows), "train", ctx, first_row=5)
    assert out.dropped == [6] and list(out.rows["margin"]) == [2.0, 0.0, 3.0]
    with pytest.raises(PipelineError, match=r"split 'train' row 7 column 'margin': a number"):
        data.datatype.format(pd.DataFrame([rows[0], {**rows[2], "margin": "big"}]), "train",
                             ctx, first_row=6)
    # without the column the pairs are as a DPO run reads them: no margin at all
    plain = data.datatype.format(pd.DataFrame(STRING_ROWS), "train", ctx)
    assert "margin" not in plain.rows.columns


# -- the run: the example file through the stages, and the SFT run's guarantees --------------

#: the shipped example, shortened: its AdamW and learning rate, 20 steps of 8 pairs (enough
#: for a reward model that ranks the held-out pairs better than its untrained head)
SHORT_EXAMPLE = {"data.max_train_samples": 256, "data.max_eval_samples": 100,
                 "data.max_seq_length": 512, "training.max_steps": 20,
                 "training.per_device_train_batch_size": 8, "logging.logging_steps": 10,
                 "checkpoint.save_strategy": "no", "eval.eval_steps": 10,
                 "eval.eval_batches": 1, "scheduler.warmup_steps": 5}
#: the equality runs: 4 steps of SGD (the two sides of a pair share most tokens, so many
#: gradient elements are differences near 0, and Adam would turn their summation-order
#: noise into full lr-sized steps; SGD keeps the runs' weights comparable), as DPO's
EQUALITY = {"training.max_steps": 4, "training.per_device_train_batch_size": 4,
            "logging.logging_steps": 1, "checkpoint.save_strategy": "steps",
            "checkpoint.save_steps": 2, "eval.eval_steps": 2, "scheduler.warmup_steps": 0,
            "optimizer.name": "SGD", "optimizer.learning_rate": 0.5}


@pytest.fixture(scope="module")
def reward_pairs(tmp_path_factory) -> Path:
    """A project whose params are the shipped params/reward-gsm8k.yaml in its resolved form,
    shortened, with download, format and tokenize done."""
    from helpers import prepared_example

    return prepared_example(tmp_path_factory.mktemp("reward") / "p", "params/reward-gsm8k.yaml",
                            SHORT_EXAMPLE)


@pytest.fixture(scope="module")
def reward_run(reward_pairs, tmp_path_factory) -> Path:
    """The shortened example trained by the train stage (its MLflow run, for the registry)."""
    from helpers import train_stage_copy

    return train_stage_copy(reward_pairs, tmp_path_factory.mktemp("reward-run") / "p")


@pytest.fixture(scope="module")
def equality_run(reward_pairs, tmp_path_factory) -> Path:
    """4 SGD steps in this process (the job the train stage hands torchrun)."""
    from helpers import train_here

    return train_here(reward_pairs, tmp_path_factory.mktemp("reward-eq") / "p", EQUALITY)[0]


def _rows(project: Path, file: str = "train.csv") -> list[dict]:
    import csv

    with open(project / "data/plots" / file) as fh:
        return list(csv.DictReader(fh))


def test_the_run_logs_trls_statistics_and_trains_the_head(reward_run):
    """Every logged row carries TRL's statistics (train and eval), and the trained folder is a
    SEQ_CLS adapter with the one-output head saved in full beside it."""
    from safetensors.torch import load_file

    rows = _rows(reward_run)
    assert [r["step"] for r in rows] == ["1", "10", "20"]
    for row in rows:
        assert 0 <= float(row["accuracy"]) <= 1
        chosen, rejected = float(row["rewards/chosen"]), float(row["rewards/rejected"])
        assert float(row["margin"]) == pytest.approx(chosen - rejected, abs=1e-4)
        assert float(row["mean_reward"]) == pytest.approx((chosen + rejected) / 2, abs=1e-4)
    assert [r["step"] for r in _rows(reward_run, "eval.csv")] == ["10", "20"]
    from mlflow.tracking import MlflowClient  # the evaluations' statistics: MLflow has them

    run_id = json.loads((reward_run / "data/lineage/train_run.json").read_text())[
        "mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{reward_run / 'mlflow.db'}")
    for name in ("eval_accuracy", "eval_margin", "eval_mean_reward", "eval_rewards/chosen"):
        history = client.get_metric_history(run_id, name)
        assert [m.step for m in history] == [10, 20], name
    accuracy = [m.value for m in client.get_metric_history(run_id, "eval_accuracy")]
    assert all(0 <= a <= 1 for a in accuracy)
    trained = reward_run / "data/trained"
    assert json.loads((trained / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    heads = [k for k in load_file(str(trained / "adapter_model.safetensors")) if "score" in k]
    assert heads and json.loads((trained / "labels.json").read_text()) == ["reward"]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_equal_one(reward_pairs, equality_run, tmp_path, strategy):
    """DDP, and FSDP2 with the head sharded as the adapter is: 2 torchrun processes x 2 pairs
    equal one process x 4 pairs (the head too)."""
    from helpers import adapter, assert_weights_close, losses, train_copy_here

    run, _ = train_copy_here(reward_pairs, tmp_path / strategy, {
        **EQUALITY, "distributed.strategy": strategy, "distributed.nproc_per_node": 2,
        "training.per_device_train_batch_size": 2})
    assert_weights_close(adapter(run), adapter(equality_run))
    assert losses(run) == pytest.approx(losses(equality_run), abs=1e-5)
    assert logged(run, "accuracy") == logged(equality_run, "accuracy")
    assert logged(run, "margin") == pytest.approx(logged(equality_run, "margin"), abs=1e-5)


def logged(project: Path, name: str) -> list[float]:
    return [float(r[name]) for r in _rows(project)]


def test_a_reward_run_resumes_bitwise_from_what_a_crash_leaves(equality_run, tmp_path):
    """The run cut back to what a SIGKILL right after its step-2 checkpoint leaves, resumed:
    it ends bitwise as the uninterrupted run (the SIGKILL itself is the SFT run's,
    tests/test_training.py; the head saved in full and the pair order are the reward run's)."""
    from helpers import resume_cut_back, train_in_place

    resume_cut_back(equality_run, tmp_path, 2, train_in_place)


@pytest.fixture(scope="module")
def reward_exported(reward_run, tmp_path_factory) -> Path:
    """The trained example evaluated and exported: its reward model registered (as
    `finetune-reward`, champion) in the project's MLflow registry."""
    import shutil

    from helpers import stages_here

    project = tmp_path_factory.mktemp("reward-exported") / "p"
    shutil.copytree(reward_run, project, symlinks=True)
    stages_here(project, "evaluate", "export")
    return project


def test_the_example_ranks_held_out_pairs_better_and_exports_a_reward_model(reward_exported):
    """Evaluate and export on the trained example: the trained reward model scores held-out
    chosen above rejected more often than the untrained head, the registry gates on it, and
    the export is what AutoModelForSequenceClassification loads (merged, one output,
    tokenizer inside) and scores pairs as the evaluate stage did."""
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    project = reward_exported
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    base, tuned = metrics["base"], metrics["finetuned"]
    assert tuned["preference_accuracy"] > base["preference_accuracy"]
    assert tuned["reward_margin"] > base["reward_margin"] and tuned["loss"] < base["loss"]
    assert all(m[f"{k}_stderr"] > 0 for m in (base, tuned) for k in ("loss", "reward_margin"))
    assert (tuned["preference_accuracy_stderr"] > 0) == (0 < tuned["preference_accuracy"] < 1)
    version = json.loads((project / "data/lineage/model_version.json").read_text())
    assert version["gate_metric"] == "eval.preference_accuracy" and version["promoted"]
    # the contamination check: the GSM8K pairs' train and test questions share no 13-gram
    assert metrics["contamination"] == {"heldout": {"overlap_fraction": 0.0,
                                                    "overlapping_rows": 0}}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    run_id = client.get_model_version(version["name"], version["version"]).run_id
    logged = client.get_run(run_id).data.metrics
    assert logged["contamination.heldout.overlap_fraction"] == 0.0

    export = project / "data/export"
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    assert model.config.num_labels == 1 and not (export / "adapter_config.json").exists()
    test = datasets.load_from_disk(str(project / "data/tokenized/test"))
    samples = json.loads((project / "data/eval/samples.json").read_text())
    with torch.no_grad():
        row = test[0]
        chosen = model(input_ids=torch.tensor([row["input_ids"]])).logits
        rejected = model(input_ids=torch.tensor([row["rejected_input_ids"]])).logits
    assert chosen.shape == (1, 1) and tok.pad_token_id == model.config.pad_token_id
    assert float(chosen) == pytest.approx(samples[0]["reward_chosen"], abs=1e-4)
    assert float(rejected) == pytest.approx(samples[0]["reward_rejected"], abs=1e-4)


def test_grpo_with_the_trained_reward_model_as_its_only_reward_raises_it(reward_exported):
    """The RLHF chain in one project: the reward model the example trained and the export
    registered (`models:/finetune-reward@champion`) is the only reward of a GRPO run (the
    shipped GRPO example, shrunk, params in their own file). The train stage resolves the
    registered model to its files and scores every completion with it, and the evaluate stage
    scores the trained policy's held-out completions above the base model's. Measured: reward
    0.54 (base) -> 1.05 (trained, 10 steps) on the 16 held-out prompts, greedy. Prompts up to
    the example's own data.max_seq_length, 320 tokens: at the tiny runs' 256, 46 of the 1,000
    GSM8K prompts are cut (to their end since 2026-11-29), and this 10-step run then went 0.43
    -> 0.22."""
    import csv
    import shutil

    from helpers import ON_STORIES, TINY, resolve_example, stages_here
    from test_grpo import TINY_GRPO

    project = reward_exported.parent / "chain"
    shutil.copytree(reward_exported, project, symlinks=True)
    resolve_example(project, "params/grpo-gsm8k.yaml", {
        **TINY, **TINY_GRPO, "grpo.reward_weights": None,
        "grpo.reward_funcs": ["models:/finetune-reward@champion"],
        "registry.gate_metric": "eval.reward", "training.max_steps": 10,
        "optimizer.learning_rate": 0.02, "eval.eval_strategy": "no",
        "checkpoint.save_steps": 10, "data.max_seq_length": 320}, *ON_STORIES,
        name="params/rlhf.yaml")
    stages_here(project, "download", "format", "tokenize", "train", "evaluate",
                params="params/rlhf.yaml")
    fetched = project / "data/reward_models/v1/finetune-reward"  # the registry's layout
    assert (fetched / "MLmodel").exists() and (fetched / "model/config.json").exists()
    with open(project / "data/plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 10
    assert [float(r["rewards/finetune_reward/mean"]) for r in rows] == pytest.approx(
        [float(r["reward"]) for r in rows], abs=1e-5)
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    base, tuned = metrics["base"]["reward"], metrics["finetuned"]["reward"]
    assert tuned > base + 0.25, (base, tuned)
