"""Streaming (`data.streaming`): the train split is read as a datasets IterableDataset and
formatted/tokenized on the fly; nothing of it is written to disk."""

from __future__ import annotations

import hashlib
import json
import shutil

import pandas as pd
import pytest
from helpers import (
    adapter,
    assert_weights_close,
    copy_project,
    logged_column,
    losses,
    resume_from_checkpoint_in_process,
    stages_here,
    train_copy_here,
    train_here,
    train_metrics,
    write_params,
)

from finetune.config import load_config
from finetune.errors import PipelineError

STREAM = {"data.streaming": True, "data.shuffle_buffer": 16}


def _examples(project, overrides: dict, epoch: int = 0) -> list[dict]:
    from tasks.stream import open_train_stream

    write_params(project, overrides)
    cfg = load_config(project / "params/default.yaml")
    return list(open_train_stream(cfg, project)(epoch))


def test_streamed_examples_are_the_tokenize_stages_and_the_buffer_shuffles(tokenized, tmp_path):
    import datasets

    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    stage_rows = datasets.load_from_disk(str(project / "data/tokenized/train"))
    expected = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in stage_rows]

    in_order = _examples(project, {**STREAM, "data.shuffle_buffer": 1})
    assert in_order == expected  # same rows, same tokens, same dropped rows, file order

    shuffled = _examples(project, STREAM)
    assert shuffled != in_order and sorted(map(str, shuffled)) == sorted(map(str, in_order))
    assert _examples(project, STREAM) == shuffled  # seeded
    assert _examples(project, STREAM, epoch=1) != shuffled  # reshuffled per epoch
    assert _examples(project, {**STREAM, "data.seed": 7}) != shuffled
    # the buffer bounds how far an example can move: a small buffer keeps the head near the head
    head = {str(x) for x in in_order[:4]}
    small = _examples(project, {**STREAM, "data.shuffle_buffer": 4})
    assert {str(x) for x in small[:1]} <= head
    assert _examples(project, {**STREAM, "data.max_train_samples": 20}) != shuffled


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """A streaming project after download/format/tokenize: only the test split on disk (the
    stage functions in this process: no process boundary is under test here)."""
    project = copy_project(tmp_path_factory.mktemp("stream") / "p",
                           {**STREAM, "logging.logging_steps": 1})
    stages_here(project, "download", "format", "tokenize")
    return project


def test_download_writes_only_the_test_split(streamed):
    assert sorted(p.name for p in (streamed / "data/raw").iterdir()) == [
        "stream.json", "test.parquet"]
    assert sorted(p.name for p in (streamed / "data/tokenized").iterdir()) == [
        "stream.json", "test"]
    manifest = json.loads((streamed / "data/raw/stream.json").read_text())
    assert manifest["shuffle_buffer"] == 16 and manifest["holdout_rows"] == 0
    source = (streamed / "data/source/gsm8k/train.jsonl").read_bytes()
    assert manifest["sha256"]["train"] == hashlib.sha256(source).hexdigest()
    # each stage passes it on with what it applies: data/tokenized (train's DVC dependency)
    # changes whenever the streamed examples would
    carried = json.loads((streamed / "data/tokenized/stream.json").read_text())
    assert carried["prompt_template"] == "Question: {question}\nAnswer:"
    assert carried["max_seq_length"] == 256 and carried["seed"] == 42
    assert {k: carried[k] for k in manifest} == manifest
    assert len(pd.read_parquet(streamed / "data/raw/test.parquet")) == 16  # max_eval_samples


@pytest.mark.distributed
def test_streamed_training_ddp_equals_single_and_differs_from_map_style(streamed, tokenized,
                                                                        tmp_path):
    common = {"training.max_steps": 4, "checkpoint.save_strategy": "no"}
    single, proc = train_here(streamed, tmp_path / "single", {
        **common, "training.per_device_train_batch_size": 8})
    assert "4 steps (streamed)" in proc.stdout
    ddp, _ = train_copy_here(streamed, tmp_path / "ddp", {
        **common, "training.per_device_train_batch_size": 4, "distributed.strategy": "ddp",
        "distributed.nproc_per_node": 2})
    assert_weights_close(adapter(single), adapter(ddp))
    assert losses(single) == pytest.approx(losses(ddp), abs=1e-5)
    # the streamed order is not the map-style permutation: the option really switches the source
    mapped, _ = train_here(tokenized, tmp_path / "mapped", {
        **common, "training.per_device_train_batch_size": 8})
    assert losses(mapped) != pytest.approx(losses(single), abs=1e-4)
    assert train_metrics(single)["num_input_tokens_seen"] > 0


def test_streamed_training_resumes_bitwise(streamed, tmp_path):
    """Epochs of 46 examples / 8 per step: 8 steps cross an epoch end and a reshuffle; the
    resumed run re-reads the stream to the checkpoint's position."""
    params = {"training.max_steps": 8, "training.per_device_train_batch_size": 4,
              "training.gradient_accumulation_steps": 2, "checkpoint.save_steps": 6,
              "eval.eval_steps": 6, "checkpoint.save_total_limit": 10}
    resume_from_checkpoint_in_process(streamed, tmp_path, params, at=6)
    assert train_metrics(tmp_path / "full")["epoch"] == 1.0


def test_holdout_when_the_source_has_no_test_split(tmp_path):
    source = {"data.data_files": None, "data.json_file_path": "data/source/gsm8k/train.jsonl",
              "data.max_train_samples": 30, "data.max_eval_samples": 5}
    project = copy_project(tmp_path / "p", {**STREAM, **source})
    stages_here(project, "download")
    rows = pd.read_json(project / "data/source/gsm8k/train.jsonl", lines=True)
    test = pd.read_parquet(project / "data/raw/test.parquet")
    assert test["question"].tolist() == rows["question"][:5].tolist()
    stages_here(project, "format", "tokenize")
    first = _examples(project, {"data.shuffle_buffer": 1})
    from engine.modeling.model import load_tokenizer

    tok = load_tokenizer(load_config(project / "params/default.yaml").model, project)
    assert rows["question"][5] in tok.decode(first[0]["input_ids"])  # starts after the holdout
    assert len(first) <= 30

    no_cap = copy_project(tmp_path / "q", {**STREAM, **source, "data.max_eval_samples": None})
    # the stage in this process: its one-line PipelineError (the CLI's exit 2 and one error:
    # line for it are tests/test_cli.py's)
    with pytest.raises(PipelineError) as refused:
        stages_here(no_cap, "download")
    line = str(refused.value)
    assert "\n" not in line, line
    assert "set data.max_eval_samples to hold out the first N streamed rows" in line, line
    assert not (no_cap / "data/raw").exists()


def test_streamed_bad_source_fails_in_download_naming_the_column(tmp_path):
    project = copy_project(tmp_path / "p", {**STREAM, "data.prompt_template": "Q: {questoin}"})
    with pytest.raises(PipelineError) as refused:  # one line, as test_holdout_when_... says
        stages_here(project, "download")
    line = str(refused.value)
    assert "\n" not in line and "questoin" in line, line


def test_epoch_train_steps_gives_a_stream_epochs(streamed, tmp_path):
    """Seed 002's nominal epoch: 2 steps, so epoch eval/save strategies work on the stream
    (evals and checkpoints at 2 and 4, and the last step), num_train_epochs sizes the run, and
    each epoch re-reads the stream reshuffled; resumed at the epoch-2 end, bitwise."""
    params = {"training.max_steps": -1, "training.num_train_epochs": 2.5,
              "training.epoch_train_steps": 2, "training.per_device_train_batch_size": 4,
              "training.gradient_accumulation_steps": 2, "eval.eval_strategy": "epoch",
              "checkpoint.save_strategy": "epoch", "checkpoint.save_total_limit": 10}
    resume_from_checkpoint_in_process(streamed, tmp_path, params, at=4)
    full = tmp_path / "full"
    assert train_metrics(full)["global_step"] == 5 and train_metrics(full)["epoch"] == 2.5
    assert logged_column(full, "step", "eval.csv") == [2, 4, 5]
    assert sorted(p.name for p in (full / "data/checkpoints").iterdir()) == [
        "step-0000002", "step-0000004", "step-0000005"]
    assert logged_column(full, "epoch")[:2] == [0.5, 1.0]
    with pytest.raises(PipelineError, match="training.epoch_train_steps: 2 needs data.streaming: true"):
        load_config(full / "params/default.yaml",
                    overrides=["data.streaming=false", "training.epoch_train_steps=2"])
