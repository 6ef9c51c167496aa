"""The train stage: outputs and tracking, loss invariances, exact resume, every loop option.

What crosses a process boundary (the stage's torchrun launch, MLflow relay, SIGKILL, DDP,
project modules imported by the workers) runs through `finetune stage train`; the options of
the loop itself run the engine's run object in-process (helpers.train_here), which is the
same code minus ~8 s of process start-up per run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    BASE,
    PER_STEP_SERIES,
    adapter,
    assert_weights_close,
    checkpoint_names,
    interrupt_then_resume,
    logged_column,
    losses,
    refused_here,
    resume_from_checkpoint_in_process,
    run_cli,
    train_copy,
    train_here,
    train_metrics,
    write_params,
)

from finetune.errors import PipelineError


def test_train_stage_outputs_and_tracking(tokenized, tmp_path):
    project, proc = train_copy(tokenized, tmp_path / "a", {"logging.run_name": "nightly-42"})
    assert "[train] step=6" in proc.stdout
    trained = project / "data/trained"
    assert (trained / "adapter_model.safetensors").exists() and (trained / "tokenizer.json").exists()
    metrics = json.loads((project / "data/metrics/train.json").read_text())
    assert metrics["global_step"] == 6 and metrics["num_input_tokens_seen"] > 0
    assert sorted(p.name for p in (project / "data/checkpoints").iterdir()) == [
        "step-0000003", "step-0000006"]
    assert len(losses(project)) == 6
    assert metrics["train_loss"] == pytest.approx(losses(project)[-1])
    run_id = json.loads((project / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.data.params["training.max_steps"] == "6"
    assert run.info.run_name == "nightly-42"
    assert run.data.tags["git_commit"] != "none" and "config_fingerprint" in run.data.tags
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    assert history[-1].value == pytest.approx(losses(project)[-1], abs=1e-5)
    assert client.get_metric_history(run_id, "eval_loss")
    # the metrics page: the per-step curves only, each point at a training step (no step-0
    # point holding the final value); the run's facts are tags
    assert set(run.data.metrics) == PER_STEP_SERIES, set(run.data.metrics) ^ PER_STEP_SERIES
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert steps and min(steps) >= 1 and len(steps) == len(set(steps)), (key, steps)
    assert run.data.tags["train.seed"] == str(metrics["seed"]) == run.data.params["training.seed"]
    assert run.data.tags["train.world_size"] == "1"
    assert run.data.tags["train.global_step"] == "6"
    assert float(run.data.tags["train.train_loss"]) == metrics["train_loss"]
    assert int(run.data.tags["train.trainable_params"]) > 0
    assert not [k for k in run.data.tags if k.startswith("train.") and k[6:] in PER_STEP_SERIES]
    # the data as MLflow records data: the tokenized splits as inputs (DVC's hash, or the
    # files' when dvc.lock has none), their statistics as a table; no data.* metrics
    assert not [k for k in run.data.metrics if k.startswith("data.")], run.data.metrics
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"train", "test"}
    assert inputs["train"].dataset.source_type == "local"
    assert str(project / "data/tokenized/train") in inputs["train"].dataset.source
    assert [t.value for t in inputs["train"].tags if t.key == "mlflow.data.context"] == ["train"]
    assert len(inputs["train"].dataset.digest) >= 32
    from pathlib import Path

    table = json.loads(Path(client.download_artifacts(run_id, "data/tokenize_stats.json"))
                       .read_text())
    assert table["columns"] == ["split", "statistic", "value"]
    assert ["train", "rows"] in [row[:2] for row in table["data"]], table


def test_gradient_accumulation_is_token_weighted(tokenized, tmp_path):
    """batch 4 x accumulation 2 trains exactly like batch 8 (HF's accumulation bug absent)."""
    common = {"training.max_steps": 4, "checkpoint.save_strategy": "no"}
    a, _ = train_here(tokenized, tmp_path / "a", {**common, "training.per_device_train_batch_size": 8})
    b, _ = train_here(tokenized, tmp_path / "b", {**common, "training.per_device_train_batch_size": 4,
                                                  "training.gradient_accumulation_steps": 2})
    assert losses(a) == pytest.approx(losses(b), abs=1e-5)
    assert_weights_close(adapter(a), adapter(b))


def test_resume_from_checkpoint_is_bitwise_exact(tokenized, tmp_path):
    """The same run, interrupted after the step-3 checkpoint, continues exactly (the curves'
    history survives the resume too)."""
    resume_from_checkpoint_in_process(tokenized, tmp_path, {}, at=3)


def test_optimizer_groups_reach_the_training_loop(tokenized, tmp_path):
    """lr 0 for lora_B keeps it at its zero init (and so the adapter inert); without the group
    it trains. A regex that matches nothing stops the run with one line."""
    common = {"training.max_steps": 3, "checkpoint.save_strategy": "no"}
    frozen, proc = train_here(tokenized, tmp_path / "g", {
        **common, "optimizer.optimizer_groups": {"lora_B": {"lr": 0.0}},
        "optimizer.log_param_groups": True})
    assert "[optimizer] group 'lora_B' {'lr': 0.0}:" in proc.stdout
    assert "[optimizer] group default:" in proc.stdout
    b_frozen = {k: v for k, v in adapter(frozen).items() if "lora_B" in k}
    assert b_frozen and all(float(v.abs().max()) == 0.0 for v in b_frozen.values())
    plain, _ = train_here(tokenized, tmp_path / "p", common)
    assert any(float(v.abs().max()) > 0 for k, v in adapter(plain).items() if "lora_B" in k)

    with pytest.raises(PipelineError) as bad:
        train_here(tokenized, tmp_path / "bad", {
            **common, "optimizer.optimizer_groups": {"mlp\\.nope": {}}})
    assert "optimizer.optimizer_groups['mlp\\.nope']: matches no trainable parameter" in str(
        bad.value)


@pytest.mark.parametrize("layout, says", [
    ({"training.packing": True, "training.packed_sequence_length": 1024},
     ["[train] packing: rows of up to 1024 tokens", "restarted position_ids"]),
    ({"training.padding_free": True},
     ["[train] padding-free: each micro-batch is one row, attention kernel sdpa_per_example"]),
], ids=["packing", "padding-free"])
def test_packing_trains_exactly_like_padding(tokenized, tmp_path, layout, says):
    """Same examples per step, packed into shared rows (or one padding-free row) with
    restarted position_ids instead of padded: same losses and weights (cross-example
    attention or a leaked boundary target would change both), fewer rows."""
    common = {"training.max_steps": 4, "checkpoint.save_strategy": "no",
              "training.per_device_train_batch_size": 8}
    padded, _ = train_here(tokenized, tmp_path / "pad", common)
    packed, proc = train_here(tokenized, tmp_path / "pack", {**common, **layout})
    for line in says:
        assert line in proc.stdout
    # really packed: several examples share a row (so cross-example attention would show)
    assert train_metrics(padded)["examples_per_row"] == 1.0
    assert train_metrics(packed)["examples_per_row"] >= 3
    if "training.padding_free" in layout:
        assert train_metrics(packed)["examples_per_row"] == 8.0
        assert train_metrics(packed)["padding_fraction"] == 0.0
    assert losses(packed) == pytest.approx(losses(padded), abs=1e-5)
    assert_weights_close(adapter(padded), adapter(packed))
    assert train_metrics(packed)["num_input_tokens_seen"] == train_metrics(padded)[
        "num_input_tokens_seen"]


@pytest.mark.parametrize("overrides", [
    {"training.packing": True, "training.packed_sequence_length": 1024},
    {"training.packing": True, "training.packed_sequence_length": 1024,
     "training.gradient_accumulation_steps": 2, "training.per_device_train_batch_size": 2},
    {"training.padding_free": True},
], ids=["packing", "packing-accumulation", "padding-free"])
def test_resume_at_a_random_checkpoint_is_bitwise(tokenized, tmp_path, overrides):
    """Each batch layout resumes exactly from any checkpoint (a crash at a random step); the
    SIGKILL itself is tested through the stage below and in test_strategies."""
    import random

    save_steps = random.Random(str(overrides)).randint(2, 5)
    resume_from_checkpoint_in_process(tokenized, tmp_path, {
        **overrides, "training.max_steps": 8, "checkpoint.save_steps": save_steps,
        "eval.eval_steps": save_steps, "checkpoint.save_total_limit": 10}, at=save_steps)


def test_ddp_with_one_process_resumes_after_sigkill(tokenized, tmp_path):
    """strategy ddp with one process runs single-device: its checkpoints record the strategy
    that ran, so preflight and the worker (one rule) accept them on resume. SIGKILLed through
    the stage right after a checkpoint, with packing and accumulation (the most state)."""
    _, cut, stdout = interrupt_then_resume(tokenized, tmp_path, {
        "distributed.strategy": "ddp", "distributed.nproc_per_node": 1,
        "training.packing": True, "training.packed_sequence_length": 1024,
        "training.gradient_accumulation_steps": 2, "training.per_device_train_batch_size": 2,
        "training.max_steps": 8, "checkpoint.save_steps": 3, "eval.eval_steps": 3,
        "checkpoint.save_total_limit": 10})
    assert "at step 3" in stdout
    from engine.state.checkpoint import read_meta

    assert read_meta(cut / "data/checkpoints/step-0000003")["strategy"] == "single"


def _eval_steps(project) -> list[int]:
    import csv

    with open(project / "data/plots/eval.csv") as fh:
        return [int(r["step"]) for r in csv.DictReader(fh)]


def test_epoch_strategies_and_group_by_length(tokenized, tmp_path):
    """Two epochs of E steps: eval and checkpoints at each epoch end, nowhere else."""
    import re

    project, proc = train_here(tokenized, tmp_path / "e", {
        "training.max_steps": -1, "training.num_train_epochs": 2,
        "eval.eval_strategy": "epoch", "checkpoint.save_strategy": "epoch",
        "checkpoint.save_total_limit": 5, "training.group_by_length": True})
    per_epoch = int(re.search(r"\((\d+)/epoch\)", proc.stdout).group(1))
    assert per_epoch > 5 and train_metrics(project)["global_step"] == 2 * per_epoch
    assert checkpoint_names(project) == [f"step-{per_epoch:07d}", f"step-{2 * per_epoch:07d}"]
    assert _eval_steps(project) == [per_epoch, 2 * per_epoch]
    plain, _ = train_here(tokenized, tmp_path / "p", {"training.max_steps": 12,
                                                      "checkpoint.save_strategy": "no"})
    grouped, plain_pad = train_metrics(project)["padding_fraction"], train_metrics(plain)[
        "padding_fraction"]
    assert grouped < plain_pad, (grouped, plain_pad)


def test_early_stopping_stops_on_a_stalled_metric(tokenized, tmp_path):
    """threshold 10: no eval can improve enough, so patience 2 stops after eval 3 (step 6)."""
    project, proc = train_here(tokenized, tmp_path / "s", {
        "training.max_steps": 12, "checkpoint.save_strategy": "no",
        "eval.eval_strategy": "steps", "eval.eval_steps": 2,
        "checkpoint.metric_for_best_model": "eval_loss",
        "eval.early_stopping_patience": 2, "eval.early_stopping_threshold": 10.0})
    assert "[train] early stopping at step 6" in proc.stdout
    m = train_metrics(project)
    assert m["global_step"] == 6 and m["best_step"] == 6  # small gains still move the best
    assert _eval_steps(project) == [2, 4, 6]


def test_best_checkpoints_kept_and_loaded_at_end(tokenized, tmp_path):
    """greater_is_better on eval_loss makes the *first* checkpoint the best (loss falls): it
    survives rotation next to the newest, and its weights become the trained model."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    project, proc = train_here(tokenized, tmp_path / "b", {
        "training.max_steps": 8, "eval.eval_strategy": "steps", "eval.eval_steps": 2,
        "checkpoint.save_steps": 2, "checkpoint.save_total_limit": 2,
        "checkpoint.metric_for_best_model": "eval_loss", "checkpoint.greater_is_better": True,
        "checkpoint.load_best_model_at_end": True})
    assert checkpoint_names(project) == ["step-0000002", "step-0000008"]
    assert "load_best_model_at_end: step-0000002" in proc.stdout
    assert train_metrics(project)["loaded_best_step"] == 2
    dcp_to_torch_save(project / "data/checkpoints/step-0000002", tmp_path / "best.pt")
    saved = torch.load(tmp_path / "best.pt", weights_only=False)["model"]
    trained = adapter(project)
    assert trained
    for key, value in trained.items():
        fqn = key.replace(".weight", ".default.weight")
        assert torch.equal(saved[fqn], value), key


def test_checkpointing_compile_determinism_anomaly_train_like_plain(tokenized, tmp_path):
    """Activation checkpointing, torch.compile (aot_eager: dynamo + AOT autograd, no C++
    toolchain), full determinism and anomaly detection change how, not what, is computed."""
    common = {"training.max_steps": 3, "checkpoint.save_strategy": "no"}
    plain, _ = train_here(tokenized, tmp_path / "p", common)
    tuned, proc = train_here(tokenized, tmp_path / "t", {
        **common, "training.gradient_checkpointing": True, "training.torch_compile": True,
        "training.torch_compile_backend": "aot_eager", "training.full_determinism": True,
        "training.detect_anomaly": True, "training.float32_matmul_precision": "high"})
    assert train_metrics(tuned)["torch_compile_graphs"] >= 1
    assert "torch_compile_graphs" not in train_metrics(plain)
    assert losses(tuned) == pytest.approx(losses(plain), abs=1e-5)
    assert_weights_close(adapter(plain), adapter(tuned))


RECORDER = '''
from pathlib import Path


class Recorder:
    """Writes each hook it sees; has no base class on purpose (duck typing is enough)."""

    def _note(self, line):
        with open(Path("hooks.log"), "a") as fh:
            fh.write(line + "\\n")

    def on_train_begin(self, state):
        self._note(f"on_train_begin {state.step}/{state.max_steps}")

    def on_step_end(self, state):
        self._note(f"on_step_end {state.step}")

    def on_log(self, state, logs):
        self._note(f"on_log {state.step} {sorted(logs)}")

    def on_evaluate(self, state, metrics):
        self._note(f"on_evaluate {state.step} {sorted(metrics)}")

    def on_save(self, state, path):
        self._note(f"on_save {state.step} {path.name}")

    def on_train_end(self, state):
        self._note(f"on_train_end {state.step}")
'''


def wandb_records(run_file):
    """The records of an offline W&B run file (LevelDB log blocks after a 7-byte header),
    parsed with wandb's own protobuf: what `wandb sync` would upload."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending = run_file.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B"
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_callbacks_and_reporters(tokenized, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    project = tmp_path / "cb"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "my_callbacks.py").write_text(RECORDER)
    write_params(project, {
        "training.max_steps": 4, "checkpoint.save_steps": 2, "eval.eval_steps": 2,
        "logging.logging_steps": 1, "logging.callbacks": ["my_callbacks:Recorder"],
        "logging.report_to": ["jsonl", "tensorboard", "wandb"], "logging.disable_tqdm": False,
        "logging.include_num_input_tokens_seen": False, "logging.run_name": "cb-run"})
    proc = run_cli(project, "stage", "train", check=True, env={"WANDB_MODE": "offline"})
    hooks = (project / "hooks.log").read_text().splitlines()
    assert hooks[0] == "on_train_begin 0/4" and hooks[-1] == "on_train_end 4"
    assert [h for h in hooks if h.startswith("on_step_end")] == [f"on_step_end {i}"
                                                                 for i in range(1, 5)]
    assert "on_evaluate 2 ['eval_loss', 'eval_perplexity']" in hooks
    assert "on_save 2 step-0000002" in hooks and "on_save 4 step-0000004" in hooks
    assert any(h.startswith("on_log 1 ['comm_bytes_per_step', 'epoch', 'grad_norm'") for h in hooks)
    # JSON lines: every logged row, no token count (include_num_input_tokens_seen: false)
    rows = [json.loads(x) for x in (project / "data/logs/train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all("num_input_tokens_seen" not in r and r.get("memory_rss_mb", 1) > 0 for r in rows)
    assert "num_input_tokens_seen" not in train_metrics(project)
    # TensorBoard event files hold the same curve
    acc = EventAccumulator(str(project / "data/logs/tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    assert [round(e.value, 4) for e in acc.Scalars("loss")] == [round(x, 4) for x in losses(project)]
    # no "mlflow" in report_to: the run exists (params, the facts as tags) without step curves
    run_id = json.loads((project / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    assert client.get_metric_history(run_id, "loss") == []
    run = client.get_run(run_id)
    assert run.data.metrics == {} and "train.train_loss" in run.data.tags
    assert "train.epoch" in run.data.tags  # no curves in MLflow: the final values are facts
    assert "4/4" in proc.stderr  # the progress bar, forced on in a non-terminal
    # W&B, offline: the relay's rows (the same losses), the run name and the params
    (run_file,) = (project / "data/logs/wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    history = [{i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = [h for h in history if "loss" in h]
    assert [h["_step"] for h in logged] == [1, 2, 3, 4]
    assert [round(h["loss"], 4) for h in logged] == [round(x, 4) for x in losses(project)]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "cb-run"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    for later in (r.config for r in records if r.WhichOneof("record_type") == "config"):
        config.update({i.key: json.loads(i.value_json) for i in later.update})
    assert config["training"]["max_steps"] == 4 and config["lineage"]["strategy"] == "single"


def test_custom_model_class_from_the_project(tokenized, tmp_path, capfd):
    project = tmp_path / "m"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "custom_model.py").write_text(
        "import os\nfrom transformers import LlamaForCausalLM\n\n\n"
        "class TaggedLlama(LlamaForCausalLM):\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        open(f'built-by-rank-{os.environ.get(\"RANK\", \"-\")}', 'w').close()\n")
    common = {"training.max_steps": 2, "checkpoint.save_strategy": "no"}
    write_params(project, {**common, "model.auto_class_name": "custom_model:TaggedLlama"})
    run_cli(project, "stage", "train", check=True)
    assert (project / "built-by-rank-0").exists()
    write_params(project, {"model.auto_class_name": "custom_model:Nope"})
    # refused by the stage in this process, in one line (its CLI exit and error: line are
    # test_cli's), before any step
    capfd.readouterr()
    line = refused_here(project, "train")
    assert "model.auto_class_name: cannot import 'custom_model:Nope'" in line, line
    assert "[train] step" not in capfd.readouterr().out


def test_dataloader_workers_keep_the_order_and_drop_last_false_adds_a_step(tokenized, tmp_path):
    """Collating in 2 persistent worker processes (across an epoch boundary) trains exactly
    like collating in the main process; drop_last false gives each epoch one more step."""
    common = {"training.max_steps": 7, "checkpoint.save_strategy": "no",
              "training.per_device_train_batch_size": 8}
    plain, proc = train_here(tokenized, tmp_path / "p", common)
    workers, _ = train_here(tokenized, tmp_path / "w", {
        **common, "training.dataloader_num_workers": 2, "training.dataloader_prefetch_factor": 2,
        "training.dataloader_persistent_workers": True})
    per_epoch = int(proc.stdout.split("/epoch)")[0].rsplit("(", 1)[1])
    assert per_epoch < 7  # the run crosses an epoch boundary
    assert losses(workers) == losses(plain)
    assert all(torch.equal(a, b) for a, b in zip(adapter(plain).values(),
                                                 adapter(workers).values()))
    _, filled = train_here(tokenized, tmp_path / "f", {**common,
                                                       "training.dataloader_drop_last": False})
    assert f"({per_epoch + 1}/epoch)" in filled.stdout


@pytest.fixture(scope="module")
def baseline(tokenized, tmp_path_factory):
    project, _ = train_here(tokenized, tmp_path_factory.mktemp("base") / "b", BASE)
    return project


@pytest.mark.parametrize("overrides, check", [
    ({"training.mixed_precision": "bf16"},  # autocast: close to fp32, not equal
     lambda run, base: losses(run) != losses(base)
     and losses(run) == pytest.approx(losses(base), abs=0.1)),
    ({"training.max_grad_norm": 1e-4},  # same first forward, then tiny clipped steps
     lambda run, base: losses(run)[0] == losses(base)[0] and losses(run)[1:] != losses(base)[1:]),
    ({"training.seed": 7},  # another data order: another first batch
     lambda run, base: losses(run)[0] != losses(base)[0]),
    ({"optimizer.weight_decay": 0.5},
     lambda run, base: losses(run)[0] == losses(base)[0] and adapter(run).keys() == adapter(
         base).keys() and any(not torch.equal(a, b) for a, b in zip(adapter(run).values(),
                                                                     adapter(base).values()))),
    ({"optimizer.name": "SGD", "optimizer.kwargs": {"momentum": 0.9}},  # step 1 is warmup (lr 0)
     lambda run, base: losses(run)[:2] == losses(base)[:2] and losses(run)[2] != losses(base)[2]),
    ({"scheduler.name": "constant", "scheduler.warmup_steps": 0},
     lambda run, base: set(logged_column(run, "learning_rate")) == {0.005}
     and len(set(logged_column(base, "learning_rate"))) > 1),
    ({"scheduler.warmup_steps": 0, "scheduler.warmup_ratio": 0.5},  # 2 of 4 steps warm up
     lambda run, base: logged_column(run, "learning_rate")[0] == pytest.approx(0.0025)),
    ({"logging.logging_steps": 2, "logging.logging_first_step": False},
     lambda run, base: logged_column(run, "step") == [2, 4] and logged_column(base, "step") == [1, 2, 3, 4]),
    ({"eval.eval_batches": 2},  # more of the test split: another eval loss
     lambda run, base: logged_column(run, "eval_loss", "eval.csv") != logged_column(base, "eval_loss",
                                                                        "eval.csv")),
    ({"training.num_train_epochs": 5},  # max_steps > 0 wins over epochs
     lambda run, base: train_metrics(run)["global_step"] == 4),
    ({"logging.logging_steps": 0, "logging.logging_first_step": False,
      "checkpoint.save_strategy": "steps",
      "checkpoint.save_steps": 0, "eval.eval_strategy": "steps", "eval.eval_steps": 0,
      "eval.eval_batches": -1},
     # the seeds' "0 disables": no periodic rows, no checkpoint, one eval at the last step,
     # over the whole test split (eval_batches -1: no cap, another loss than the base's one
     # batch; eval_batches 0 evaluates nothing, tests/test_options.py)
     lambda run, base: logged_column(run, "step") == [4] and logged_column(run, "step", "eval.csv") == [4]
     and not any((run / "data/checkpoints").glob("step-*"))
     and logged_column(run, "eval_loss", "eval.csv")[-1] != logged_column(base, "eval_loss", "eval.csv")[-1]),
    ({"eval.eval_strategy": "steps", "eval.eval_steps": 1, "eval.eval_delay": 3},
     lambda run, base: logged_column(run, "step", "eval.csv") == [3, 4]),
    ({"logging.logging_strategy": "no", "logging.logging_first_step": False,
      "logging.log_level": "warning"},  # one row (the final step's), nothing on stdout
     lambda run, base: logged_column(run, "step") == [4] and len(logged_column(base, "step")) == 4),
    ({"training.speed_metrics_start_step": 2},  # tokens/s counts steps 3 and 4 only
     lambda run, base: train_metrics(run)["speed_metrics_start_step"] == 2
     and train_metrics(base)["speed_metrics_start_step"] == 0
     and train_metrics(run)["train_tokens_per_second"] > 0
     and train_metrics(run)["train_steps_per_second"] > 0),
], ids=["bf16", "max_grad_norm", "seed", "weight_decay", "optimizer", "scheduler", "warmup_ratio",
        "logging_steps", "eval_batches", "max_steps_wins", "zero_disables", "eval_delay",
        "logging_strategy_no", "speed_metrics_start_step"])
def test_each_loop_option_changes_the_run(tokenized, tmp_path, baseline, overrides, check):
    run, proc = train_here(tokenized, tmp_path / "r", {**BASE, **overrides})
    assert check(run, baseline)
    if overrides.get("logging.log_level") == "warning":
        assert "[train]" not in proc.stdout, proc.stdout
