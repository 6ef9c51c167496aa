"""KTO (training.type kto, data.dataset_type unpaired_preference): the loss and the logged
statistics against TRL's KTOTrainer (the oracle), the rows as the type makes them, and the
run's guarantees (DDP, resume) as the SFT run has them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT
from test_preference import CHAT_TEMPLATE, STRING_ROWS, _models, _tokenizer

#: labelled completions: each pair's chosen side desirable, its rejected side not, one row each
#: (a batch of 6 with both labels, rows of different lengths)
STRING_ROWS_KTO = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                   for r in STRING_ROWS for side in ("chosen", "rejected")]
CHAT_ROWS_KTO = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                  "completion": [{"role": "assistant", "content": r["completion"].strip()}],
                  "label": r["label"]} for r in STRING_ROWS_KTO]


def _encode(rows: list[dict], chat: bool) -> tuple[list[dict], pd.DataFrame]:
    """The rows as the unpaired_preference type formats and tokenizes them."""
    from finetune.config.data import DataConfig
    from finetune.datatypes import DataContext

    data = DataConfig(dataset_type="unpaired_preference", data_files={"train": "x.jsonl"},
                      chat_template=CHAT_TEMPLATE if chat else None)
    tok = _tokenizer()
    ctx = DataContext(ROOT, lambda: tok)
    formatted = data.datatype.format(pd.DataFrame(rows), "train", ctx)
    assert formatted.dropped == []
    fn, kwargs = data.datatype.encoder(ctx)
    enc = fn(formatted.rows.to_dict("list"), tok=tok, **kwargs)
    keys = ("input_ids", "labels", "desirable")
    return [dict(zip(keys, values)) for values in zip(*(enc[k] for k in keys))], formatted.rows


def _ours(policy, ref, rows: list[dict], kto) -> tuple[float, dict]:
    """Our loss and logged statistics of one step on `rows`, as the run computes them."""
    from engine.datapath.data import collate
    from engine.objective.logprobs import sequence_logps
    from engine.recipe.kto.batches import collate_unpaired, mismatched
    from engine.recipe.kto.loss import SUMS, clamped_mean, kl_estimate, kto_loss, window_means

    tok = _tokenizer()
    batch = collate_unpaired(rows, lambda r: collate(r, tok.pad_token_id), max_len=512)

    def logps(model, b):
        return sequence_logps(model(input_ids=b["input_ids"],
                                    attention_mask=b["attention_mask"]).logits, b["labels"])[0]

    with torch.no_grad():
        kl = clamped_mean(kl_estimate(logps(policy, mismatched(batch)),
                                      logps(ref, mismatched(batch))))
        ref_logps = logps(ref, batch)
    out = kto_loss(kto, logps(policy, batch), ref_logps, batch["desirable"], kl)
    return float(out.losses.mean().detach()), window_means(dict(zip(SUMS, out.sums().tolist())))


def _trl_kto(tmp_path, policy, ref, rows: list[dict], **config) -> tuple[float, dict]:
    """TRL's KTOTrainer loss on the same token ids in its layout (prompt / completion split at
    the label mask; the KL completions rotated by one within the batch, as its dataset map
    does), collated by its own collator."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(rows), **config)
    trainer = KTOTrainer(model=policy, ref_model=ref, args=args, processing_class=_tokenizer(),
                         train_dataset=Dataset.from_list(STRING_ROWS_KTO))
    examples = []
    for r in rows:
        start = next(i for i, x in enumerate(r["labels"]) if x != -100)
        examples.append({"prompt_ids": r["input_ids"][:start],
                         "completion_ids": r["input_ids"][start:], "label": bool(r["desirable"])})
    for example, previous in zip(examples, examples[-1:] + examples[:-1]):
        example["KL_completion_ids"] = previous["completion_ids"]
    policy.train()
    loss = trainer._compute_loss(policy, trainer.data_collator(examples), return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("chat, weights", [(False, (1.0, 1.0)), (True, (1.3, 0.7))],
                         ids=["strings", "conversational-weighted"])
def test_loss_and_statistics_equal_trls(tmp_path, chat, weights):
    from finetune.config.kto import KTOConfig

    rows, _ = _encode(CHAT_ROWS_KTO if chat else STRING_ROWS_KTO, chat)
    # the perturbed copy as the reference: the real model finds text likelier, so the KL
    # estimate is above 0 and not clamped away (the other way round it is clamped to 0)
    ref, policy = _models()
    kto = KTOConfig(beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1])
    ours, stats = _ours(policy, ref, rows, kto)
    theirs, trl_stats = _trl_kto(tmp_path, policy, ref, rows, beta=0.3,
                                 desirable_weight=weights[0], undesirable_weight=weights[1])
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    assert stats["kl"] > 0  # the perturbed policy: the clamp does not hide the estimate
    assert set(stats) == {"rewards/chosen", "rewards/rejected", "rewards/margins",
                          "logps/chosen", "logps/rejected", "kl"}
    for name, value in stats.items():
        assert abs(value - trl_stats[name]) < 1e-5 * max(1.0, abs(value)), name


def test_conversational_rows_are_what_the_chat_template_renders():
    """The completion is what the full conversation adds after the prompt's rendering with the
    generation prompt (TRL's split), end-of-turn marker included; no EOS on top."""
    tok = _tokenizer()
    rows, formatted = _encode(CHAT_ROWS_KTO, chat=True)
    for row, encoded, f in zip(CHAT_ROWS_KTO, rows, formatted.itertuples()):
        prompt = tok.apply_chat_template(row["prompt"], chat_template=CHAT_TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(row["prompt"] + row["completion"],
                                       chat_template=CHAT_TEMPLATE, tokenize=False)
        assert full[len(prompt):] == f.completion and f.eos is False and f.label is row["label"]
        trained = [t for t, x in zip(encoded["input_ids"], encoded["labels"]) if x != -100]
        assert trained == tok(f.completion, add_special_tokens=False)["input_ids"]
        assert encoded["desirable"] == int(row["label"])


def _format(rows: list[dict], first_row: int = 0):
    from finetune.config.data import DataConfig
    from finetune.datatypes import DataContext

    data = DataConfig(dataset_type="unpaired_preference", data_files={"train": "x.jsonl"})
    return data.datatype.format(pd.DataFrame(rows), "train", DataContext(ROOT, _tokenizer),
                                first_row)


def test_rows_with_nothing_to_learn_are_dropped_and_counted():
    out = _format([*STRING_ROWS_KTO[:2], {"prompt": "Q", "completion": "  ", "label": True},
                   {"prompt": "Q", "completion": None, "label": False}], first_row=10)
    assert out.dropped == [12, 13] and out.reason == "an empty completion"
    assert list(out.rows["label"]) == [True, False] and list(out.rows["eos"]) == [True, True]


@pytest.mark.parametrize("label", [1, "true", None])
def test_a_label_that_is_not_a_bool_is_one_line_naming_the_row(label):
    from finetune.errors import PipelineError

    rows = [*STRING_ROWS_KTO[:2], {"prompt": "Q", "completion": " x", "label": label}]
    with pytest.raises(PipelineError) as err:
        _format(rows, first_row=5)
    assert str(err.value) == (f"split 'train' row 7 column 'label': must be true or false "
                              f"(desirable or not), got {label!r}")


# -- the run: the example file through the stages, and the SFT run's guarantees --------------

#: the DPO tests' shrunk run (SGD: tests/test_preference.py says why), as 2 micro-batches of
#: 2 rows per step, so that 2 processes x 2 rows see the same micro-batches
TINY_KTO = {"data.max_seq_length": 512, "training.max_steps": 4, "data.max_train_samples": 32,
            "data.max_eval_samples": 16, "eval.max_generation_samples": 4,
            "logging.logging_steps": 1, "checkpoint.save_steps": 2, "eval.eval_steps": 2,
            "scheduler.warmup_steps": 0, "optimizer.name": "SGD",
            "optimizer.learning_rate": 0.05, "training.per_device_train_batch_size": 2,
            "training.gradient_accumulation_steps": 2}


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    """A project whose params are the shipped params/kto-gsm8k.yaml in its resolved form (on
    the shipped stories260K instead of the default run's export), shrunk, with download,
    format and tokenize done."""
    from helpers import ON_STORIES, prepared_example

    return prepared_example(tmp_path_factory.mktemp("kto") / "p", "params/kto-gsm8k.yaml",
                            TINY_KTO, *ON_STORIES)


@pytest.fixture(scope="module")
def kto_run(labelled, tmp_path_factory) -> Path:
    """The shrunk example trained by the train stage (its MLflow run, for the registry)."""
    from helpers import train_stage_copy

    return train_stage_copy(labelled, tmp_path_factory.mktemp("kto-run") / "p")


def _rows(project: Path, file: str = "train.csv") -> list[dict]:
    import csv

    with open(project / "data/plots" / file) as fh:
        return list(csv.DictReader(fh))


def test_the_run_starts_at_one_half_and_logs_trls_statistics(kto_run):
    """A fresh LoRA adapter leaves the policy equal to the reference (the adapter disabled):
    every reward and the KL estimate are 0, so every row's loss is 1 - sigmoid(0) = 0.5. Then
    the logged rows carry TRL's statistics, and the evaluations the held-out rows' loss."""
    rows = _rows(kto_run)
    assert len(rows) == 4 and abs(float(rows[0]["loss"]) - 0.5) < 1e-6
    assert float(rows[0]["rewards/chosen"]) == 0.0 and float(rows[0]["kl"]) == 0.0
    for row in rows[1:]:  # the policy has moved
        assert float(row["loss"]) != 0.5
        assert float(row["logps/chosen"]) < 0 and float(row["logps/rejected"]) < 0
        assert float(row["kl"]) >= 0
    assert any(float(r["rewards/margins"]) != 0 for r in rows[1:] if r["rewards/margins"])
    evals = _rows(kto_run, "eval.csv")
    assert [r["step"] for r in evals] == ["2", "4"]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_equal_one(labelled, kto_run, tmp_path, strategy):
    """DDP, and FSDP2 with the reference forward through the sharded model (the adapter
    disabled), on 2 torchrun processes x 2 rows equal one process x 2 micro-batches of 2: the
    KL estimate is the step's, over every micro-batch on every rank."""
    from helpers import adapter, assert_weights_close, losses, train_copy_here

    run, _ = train_copy_here(labelled, tmp_path / strategy, {
        "distributed.strategy": strategy, "distributed.nproc_per_node": 2,
        "training.gradient_accumulation_steps": 1})
    assert_weights_close(adapter(run), adapter(kto_run))
    assert losses(run) == pytest.approx(losses(kto_run), abs=1e-5)
    assert _column(run, "kl") == pytest.approx(_column(kto_run, "kl"), abs=1e-6)


def _column(project: Path, name: str) -> list[float]:
    return [float(r[name]) for r in _rows(project)]


def test_a_kto_run_resumes_bitwise_from_what_a_crash_leaves(kto_run, tmp_path):
    """The run cut back to what a SIGKILL right after its step-2 checkpoint leaves, resumed:
    it ends bitwise as the uninterrupted run (the SIGKILL itself and the stage's resume are the
    SFT run's, tests/test_training.py)."""
    from helpers import resume_cut_back, train_in_place

    resume_cut_back(kto_run, tmp_path, 2, train_in_place)


def test_the_example_runs_through_evaluate_and_export(kto_run, tmp_path):
    """The last two stages on the trained example: the evaluate stage reports where the base's
    and the fine-tuned model's implicit reward puts the held-out completions, the registry
    gates on it."""
    import shutil

    from helpers import stages_here

    project = tmp_path / "p"
    shutil.copytree(kto_run, project, symlinks=True)
    stages_here(project, "evaluate", "export")
    metrics = json.loads((project / "data/metrics/eval.json").read_text())
    base, tuned = metrics["base"], metrics["finetuned"]
    assert base["kto_accuracy"] == 0.5 and base["reward_margin"] == 0  # its own reference
    assert base["desirable_accuracy"] == base["undesirable_accuracy"] == 0.5
    # the 16 held-out rows are 8 pairs unpaired: 8 desirable, 8 not
    assert tuned["kto_accuracy"] == pytest.approx(
        (tuned["desirable_accuracy"] + tuned["undesirable_accuracy"]) / 2)
    assert tuned["reward_margin"] != 0 and tuned["desirable_accuracy"] != 0.5
    # bootstrap stderrs of the accuracies (the margin, a difference of two labels' means: none)
    assert base["kto_accuracy_stderr"] == base["desirable_accuracy_stderr"] == 0
    assert (tuned["kto_accuracy_stderr"] > 0) == (0 < tuned["kto_accuracy"] < 1)
    assert "undesirable_accuracy_stderr" in tuned and "reward_margin_stderr" not in tuned
    version = json.loads((project / "data/lineage/model_version.json").read_text())
    assert version["gate_metric"] == "eval.kto_accuracy"
    assert version["value"] == tuned["kto_accuracy"]
