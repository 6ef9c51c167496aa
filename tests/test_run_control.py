"""Run control and the loop's extension points (issues 20, 21): resume by path, callbacks that
steer the run, user optimizer/scheduler/loss/model/loop, memory levers, checkpoint retention.

Apart from test_training.py so the two files run side by side (pytest-xdist, one file per
worker); each trains in-process (tests/helpers.train_here) on the session's tokenized project.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    BASE,
    adapter,
    assert_weights_close,
    checkpoint_names,
    logged_column,
    losses,
    train_copy,
    train_here,
    train_in_place,
    train_metrics,
    write_params,
)

from finetune.config.schema import FinetuneConfig
from finetune.errors import PipelineError


def test_resume_by_path_picks_that_checkpoint_over_a_newer_one(tokenized, tmp_path):
    """Seeds 000/002/004: resume_from_checkpoint names a checkpoint. The run continues from
    step 4 although step 8 is newer, the later ones move aside, and the weights equal the
    uninterrupted run's."""
    params = {"training.max_steps": 8, "checkpoint.save_steps": 2,
              "checkpoint.save_total_limit": None}
    full, _ = train_here(tokenized, tmp_path / "full", params)
    uninterrupted = adapter(full)
    write_params(full, {"checkpoint.resume_from_checkpoint": "data/checkpoints/step-0000004"})
    proc = train_in_place(full)
    assert "resumed from" in proc.stdout and "step-0000004 at step 4" in proc.stdout
    assert checkpoint_names(full) == ["step-0000002", "step-0000004", "step-0000006",
                                  "step-0000008"]  # 6 and 8 written again by the resume
    moved = next((full / "data/checkpoints.previous").iterdir())
    assert sorted(p.name for p in moved.iterdir()) == ["step-0000006", "step-0000008"]
    resumed = adapter(full)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    with pytest.raises(PipelineError, match=r"resume_from_checkpoint: .*step-0000009 is not a "
                       "complete checkpoint"):
        write_params(full, {"checkpoint.resume_from_checkpoint": "data/checkpoints/step-0000009"})
        train_in_place(full)


def test_optimizer_in_backward_trains_like_the_step_after_backward(tokenized, tmp_path):
    """fuse_optim_with_backward updates each parameter inside backward; Adam's update is
    per parameter, so the run is the ordinary one (no clipping on either side)."""
    plain, _ = train_here(tokenized, tmp_path / "p", {**BASE, "training.max_grad_norm": None})
    fused, _ = train_here(tokenized, tmp_path / "f", {**BASE, "training.max_grad_norm": None,
                                                      "training.fuse_optim_with_backward": True})
    assert losses(fused) == pytest.approx(losses(plain), abs=1e-6)
    assert_weights_close(adapter(fused), adapter(plain))
    grad_norms = logged_column(fused, "grad_norm")
    assert all(g != g for g in grad_norms)  # nan: no gradient outlives its update
    assert all(g == g for g in logged_column(plain, "grad_norm"))
    data = {"data": {"json_file_path": "x.jsonl"}}
    for section, extra, message in (
            ("training", {}, "fuse_optim_with_backward: true does not combine with max_grad_norm"),
            ("training", {"max_grad_norm": None, "gradient_accumulation_steps": 2},
             "does not combine with gradient_accumulation_steps > 1"),
            ("training", {"max_grad_norm": None, "mixed_precision": "fp16"},
             "does not combine with mixed_precision fp16"),
            ("distributed", {"strategy": "ddp"}, "needs distributed.strategy single")):
        training = {"fuse_optim_with_backward": True, **(extra if section == "training" else
                                                         {"max_grad_norm": None})}
        raw = {**data, "training": training}
        if section == "distributed":
            raw["distributed"] = extra
        with pytest.raises(ValueError, match=message):
            FinetuneConfig.model_validate(raw)


def test_group_by_length_reads_the_length_column_it_is_told(tokenized, tmp_path):
    import datasets

    from engine.datapath.data import ShardedBatches
    from engine.datapath.loader import example_lengths

    split = tokenized / "data/tokenized/train"
    ds = datasets.load_from_disk(str(split))
    assert ds["length"] == [len(x) for x in ds["input_ids"]]  # written by tokenize
    by_tokens, by_trainable = example_lengths(split, "length"), example_lengths(split,
                                                                               "n_trainable")
    assert by_trainable.dtype == "int32"  # a numpy array, 4 bytes a row: no Python ints
    assert by_trainable.tolist() == ds["n_trainable"] and by_trainable.tolist() != ds["length"]
    order = [ShardedBatches(len(ds), 4, 0, 1, 42, lengths=lengths).epoch(0).tolist()
             for lengths in (by_tokens, by_trainable)]
    assert order[0] != order[1]
    with pytest.raises(PipelineError, match=r"training.length_column_name 'nope' is not a "
                       r"column of the tokenized train split \(columns: input_ids, labels"):
        example_lengths(split, "nope")
    run, _ = train_here(tokenized, tmp_path / "g", {**BASE, "training.group_by_length": True,
                                                    "training.length_column_name": "n_trainable"})
    assert train_metrics(run)["global_step"] == 4


def test_preserve_n_best_keeps_the_best_apart_from_the_newest(tokenized, tmp_path):
    """greater_is_better makes the earliest checkpoints the best: the newest one
    (save_total_limit 1) and the two best (preserve_n_best 2) survive; without
    preserve_n_best the rule is the newest plus one best."""
    project, _ = train_here(tokenized, tmp_path / "b", {
        "training.max_steps": 8, "eval.eval_strategy": "steps", "eval.eval_steps": 2,
        "checkpoint.save_steps": 2, "checkpoint.save_total_limit": 1,
        "checkpoint.metric_for_best_model": "eval_loss", "checkpoint.greater_is_better": True,
        "checkpoint.preserve_n_best": 2})
    assert checkpoint_names(project) == ["step-0000002", "step-0000004", "step-0000008"]
    with pytest.raises(ValueError, match="checkpoint.preserve_n_best: 2 needs checkpoint.metric_for_best_model"):
        FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"},
                                       "checkpoint": {"preserve_n_best": 2}})


STEERING = """
from engine.reporting.callbacks import Callback


class Steer(Callback):
    \"\"\"Stops at `stop_at`, asks for a checkpoint at `save_at`; counts epochs and steps in a
    state that checkpoints carry.\"\"\"

    def __init__(self, stop_at, save_at):
        self.stop_at, self.save_at = stop_at, save_at
        self.counts = {"epochs": 0, "steps": 0, "ends": 0}
        self.restored = None

    def on_epoch_begin(self, state):
        self.counts["epochs"] += 1

    def on_step_begin(self, state):
        self.counts["steps"] += 1

    def on_epoch_end(self, state):
        self.counts["ends"] += 1

    def on_step_end(self, state):
        if state.step == self.save_at:
            state.control.should_save = True
        if state.step == self.stop_at:
            state.control.should_training_stop = True

    def state_dict(self):
        return dict(self.counts)

    def load_state_dict(self, state):
        self.restored = dict(state)
        self.counts = dict(state)

    def on_train_end(self, state):
        import json
        with open("steer.json", "w") as fh:
            json.dump({"counts": self.counts, "restored": self.restored, "step": state.step}, fh)
"""


def test_a_callback_steers_the_run_and_its_state_is_checkpointed(tokenized, tmp_path,
                                                                 monkeypatch):
    """A callback built with kwargs asks for a checkpoint at step 2 (save_steps is 50) and to
    stop at step 3: the run ends at 3 (HF's TrainerControl); its state is in the checkpoints
    and, with restore_callback_states_from_checkpoint, comes back on resume."""
    project = tmp_path / "s"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "steer_cb.py").write_text(STEERING)
    monkeypatch.chdir(project)
    spec = {"class": "steer_cb:Steer", "kwargs": {"stop_at": 3, "save_at": 2}}
    write_params(project, {**BASE, "training.max_steps": 6, "checkpoint.save_strategy": "steps",
                           "checkpoint.save_steps": 50, "logging.callbacks": [spec]})
    proc = train_in_place(project)
    assert train_metrics(project)["global_step"] == 3
    assert "stopping at step 3: a callback set control.should_training_stop" in proc.stdout
    assert checkpoint_names(project) == ["step-0000002", "step-0000003"]
    steer = json.loads((project / "steer.json").read_text())
    assert steer["counts"] == {"epochs": 1, "steps": 3, "ends": 0} and steer["restored"] is None
    # resume from step 2 with the state restored: the counts continue from the checkpoint's
    write_params(project, {"checkpoint.resume_from_checkpoint": "data/checkpoints/step-0000002",
                           "logging.restore_callback_states_from_checkpoint": True,
                           "logging.callbacks": [{**spec, "kwargs": {"stop_at": 4,
                                                                     "save_at": 0}}]})
    train_in_place(project)
    steer = json.loads((project / "steer.json").read_text())
    assert steer["restored"] == {"epochs": 1, "steps": 2, "ends": 0}
    assert steer["counts"]["steps"] == 4 and steer["step"] == 4
    with pytest.raises(PipelineError, match="'steer_cb:Steer' cannot be built with kwargs"):
        write_params(project, {"logging.callbacks": [{"class": "steer_cb:Steer",
                                                      "kwargs": {"nope": 1}}]})
        train_in_place(project)


USER_OPTIM = """
import torch


class CountingAdamW(torch.optim.AdamW):
    steps = 0

    def step(self, closure=None):
        type(self).steps += 1
        with open("optimizer_steps.txt", "w") as fh:
            fh.write(str(type(self).steps))
        return super().step(closure)


def flat(optimizer, num_warmup_steps, num_training_steps, factor=1.0):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor)


def not_a_schedule(optimizer, **kwargs):
    return 3
"""


def test_user_optimizer_class_and_scheduler_function(tokenized, tmp_path):
    project = tmp_path / "o"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "user_optim.py").write_text(USER_OPTIM)
    run, _ = train_here(project, tmp_path / "r", {
        **BASE, "optimizer.name": "user_optim:CountingAdamW",
        "scheduler.name": "user_optim:flat", "scheduler.kwargs": {"factor": 0.5},
        "scheduler.warmup_steps": 0})
    assert (run / "optimizer_steps.txt").read_text() == "4"  # the run's cwd: its project
    assert set(logged_column(run, "learning_rate")) == {0.0025}  # 0.005 x factor, never decayed
    for key, value, message in (
            ("optimizer.name", "user_optim:flat", "is not a torch.optim.Optimizer subclass"),
            ("scheduler.name", "user_optim:not_a_schedule", "returned int, not an LR scheduler"),
            ("scheduler.name", "user_optim:missing", "has no attribute 'missing'")):
        with pytest.raises(PipelineError, match=message):
            train_here(project, tmp_path / f"bad{len(message)}", {**BASE, key: value})


USER_LOOP = """
from engine.recipe.run import TrainingRun


class CountingRun(TrainingRun):
    def train_step(self):
        with open("loop_steps.txt", "a") as fh:
            fh.write("x")
        return super().train_step()
"""


USER_LOSS = """
import torch


def doubled(outputs, labels, num_items_in_batch):
    logits = outputs.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), reduction="sum")
    return 2 * loss / num_items_in_batch
"""


def test_compute_loss_func_is_the_objective(tokenized, tmp_path, monkeypatch):
    """An HF-style loss function (sum / num_items_in_batch) that doubles the cross entropy:
    the logged loss is twice the built-in one at step 1 (the same weights)."""
    project = tmp_path / "l"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "user_loss.py").write_text(USER_LOSS)
    monkeypatch.chdir(project)
    run, _ = train_here(project, tmp_path / "r", {
        **BASE, "training.compute_loss_func": "user_loss:doubled"})
    plain, _ = train_here(project, tmp_path / "p", BASE)
    assert losses(run)[0] == pytest.approx(2 * losses(plain)[0], rel=1e-5)


FUSED = """
import torch


def plain_ce():
    def loss(hidden, weight, labels):
        logits = (hidden @ weight.T).float()
        return torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    return loss
"""


def test_fused_loss_factory_trains_like_the_default_loss(tokenized, tmp_path, monkeypatch):
    """training.fused_loss_factory: a factory whose function is the plain cross entropy of
    (hidden, weight, labels) trains exactly as the built-in chunked loss does."""
    project = tmp_path / "f"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "user_fused.py").write_text(FUSED)
    monkeypatch.chdir(project)
    run, proc = train_here(project, tmp_path / "r", {
        **BASE, "training.fused_loss_factory": "user_fused:plain_ce"})
    assert "[train] fused loss from user_fused:plain_ce (probe: loss error" in proc.stdout
    plain, _ = train_here(project, tmp_path / "p", BASE)
    assert losses(run) == pytest.approx(losses(plain), rel=1e-5)
    assert len(losses(run)) == 4
    assert_weights_close(adapter(run), adapter(plain))


MODEL_INIT = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, max_position_embeddings=512))


def not_a_model():
    return torch.nn.Linear(2, 2)
"""


def test_model_init_builds_the_base_model(tokenized, tmp_path, monkeypatch):
    project = tmp_path / "mi"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "user_model.py").write_text(MODEL_INIT)
    monkeypatch.chdir(project)
    run, _ = train_here(project, tmp_path / "r", {**BASE, "model.model_init": "user_model:tiny"})
    assert train_metrics(run)["total_params"] < 100_000  # stories260K has 352,512
    with pytest.raises(PipelineError, match="returned Linear, not a transformers PreTrainedModel"):
        train_here(project, tmp_path / "bad", {**BASE, "model.model_init": "user_model:not_a_model"})


def test_training_type_picks_the_loop(tokenized, tmp_path):
    project = tmp_path / "t"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "user_loop.py").write_text(USER_LOOP)
    run, _ = train_here(project, tmp_path / "r", {**BASE, "training.type": "user_loop:CountingRun"})
    assert (run / "loop_steps.txt").read_text() == "xxxx"  # the run's cwd: its project
    with pytest.raises(PipelineError, match=r"training.type 'ppo': no such trainer "
                       r"\(registered: distill, dpo, grpo, kto, reward, rloo, sft"):
        train_here(project, tmp_path / "bad", {**BASE, "training.type": "ppo"})


def test_an_unseeded_run_records_its_seed_and_a_resume_keeps_it(tokenized, tmp_path):
    """training.seed: null (seed 003): the stage draws a seed, the run trains with it (the same
    losses as naming it), MLflow, the metrics and the checkpoints record it, and a resume
    continues with the checkpoint's (else its fingerprint would differ and it would refuse)."""
    from mlflow.tracking import MlflowClient

    from engine.state.checkpoint import read_meta
    from finetune.workspace import Workspace
    from tasks.train import with_resolved_seed

    params = {**BASE, "training.seed": None, "checkpoint.save_strategy": "steps",
              "checkpoint.save_steps": 2}
    full, proc = train_copy(tokenized, tmp_path / "full", params)
    seed = train_metrics(full)["seed"]
    assert isinstance(seed, int) and f"training.seed null: drew seed {seed}" in proc.stdout
    run_id = json.loads((full / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    run = MlflowClient(tracking_uri=f"sqlite:///{full / 'mlflow.db'}").get_run(run_id)
    assert run.data.params["training.seed"] == str(seed)
    assert read_meta(full / "data/checkpoints/step-0000002")["seed"] == seed
    named, _ = train_here(tokenized, tmp_path / "named", {**params, "training.seed": seed})
    assert losses(named) == losses(full)
    fresh = Workspace.load(full / "params/default.yaml")
    drawn = {with_resolved_seed(fresh).config.training.seed for _ in range(3)}
    assert len(drawn) == 3  # resume_from_checkpoint false: a new draw each time
    # a resume takes the checkpoint's seed (any other would fail its fingerprint check), by
    # path or the latest; the resume itself is then an ordinary seeded one
    for resume in ("data/checkpoints/step-0000002", True):
        write_params(full, {"checkpoint.resume_from_checkpoint": resume})
        resumed = with_resolved_seed(Workspace.load(full / "params/default.yaml"))
        assert resumed.config.training.seed == seed


COLLATE = """
import torch

from engine.datapath.data import collate


def to_64(rows):
    # the trainer's padding, to a fixed 64 columns, with the calls counted
    with open("collate_calls.txt", "a") as fh:
        fh.write(str(len(rows)) + chr(10))
    return collate(rows, pad_id=0, multiple=64)


def a_list(rows):
    return [r["input_ids"] for r in rows]
"""


def test_a_user_collate_fn_batches_the_training_examples(tokenized, tmp_path, monkeypatch):
    """data.collate_fn (seed 004) builds every training batch and the in-training evaluation's:
    padding to 64 columns costs the attention more positions but trains the same tokens, so
    the losses equal the default padding's; a collator that returns no batch is one line
    before launch."""
    from tasks.train import preflight

    project = tmp_path / "c"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "my_collate.py").write_text(COLLATE)
    monkeypatch.chdir(project)
    write_params(project, {**BASE, "data.collate_fn": "my_collate:to_64"})
    train_in_place(project)
    calls = (project / "collate_calls.txt").read_text().split()
    from finetune.workspace import Workspace

    cfg = Workspace.load(project / "params/default.yaml").config
    batch, eval_batch = (cfg.training.per_device_train_batch_size,
                         cfg.training.per_device_eval_batch_size)
    assert batch != eval_batch and cfg.eval.eval_batches == 1
    # one call per micro-batch and one for the final step's evaluation batch, nothing else
    # collated by it; the prefetch thread may have collated up to three more training batches
    # (two queued, one in hand) before the run ended
    train_calls = [c for c in calls if c != str(eval_batch)]
    assert train_calls == [str(batch)] * len(train_calls) and 4 <= len(train_calls) <= 7
    assert calls.count(str(eval_batch)) == 1
    plain, _ = train_here(tokenized, tmp_path / "p", BASE)
    assert losses(project) == pytest.approx(losses(plain), abs=1e-5)
    write_params(project, {"data.collate_fn": "my_collate:a_list"})
    monkeypatch.syspath_prepend(str(project))
    with pytest.raises(PipelineError, match=r"data.collate_fn: 'my_collate:a_list' must return "
                       "a mapping with input_ids and labels"):
        preflight(Workspace.load(project / "params/default.yaml"))
    with pytest.raises(ValueError, match="data.collate_fn: .* does not combine with training.packing"):
        FinetuneConfig.model_validate({"data": {"collate_fn": "m:f", "json_file_path": "x"},
                                       "training": {"packing": True}})


OVERLAP = """
import threading
import time

from engine.datapath.data import collate

CALLS = []  # (thread id) of each collate call


def padded(rows):
    CALLS.append(threading.get_ident())
    return collate(rows, pad_id=0)


def note(line):
    with open("seen.txt", "a") as fh:
        fh.write(line + chr(10))


class WaitsForTheNextBatch:
    # at the end of step k, batch k+1 must be collated without the loop asking for it
    def on_step_end(self, state):
        deadline = time.monotonic() + 10
        while len(CALLS) < state.step + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        off_main = threading.get_ident() not in CALLS
        note(f"{state.step} {len(CALLS)} {off_main}")


class Order:
    def on_step_end(self, state):
        note(f"end {state.step}")

    def on_log(self, state, logs):
        if "loss" in logs:
            note(f"log {state.step}")
"""


def _seen(project) -> list[str]:
    return (project / "seen.txt").read_text().splitlines()


def _overlap_project(tokenized, tmp_path, name: str, overrides: dict):
    project = tmp_path / name
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "overlap_cb.py").write_text(OVERLAP)
    write_params(project, {**BASE, **overrides})
    return project


def test_batches_are_collated_ahead_on_a_background_thread(tokenized, tmp_path):
    """With no DataLoader workers, the next micro-batch is collated while the current step
    runs (engine.datapath.prefetch), off the thread that drives the model: at the end of every step
    the next batch already exists (a loop that collates when it needs a batch waits 10 s
    here and fails)."""
    project = _overlap_project(tokenized, tmp_path, "ahead", {
        "data.collate_fn": "overlap_cb:padded", "training.dataloader_num_workers": 0,
        "logging.callbacks": ["overlap_cb:WaitsForTheNextBatch"]})
    train_in_place(project)
    seen = [line.split() for line in _seen(project)]
    assert [int(step) for step, _, _ in seen] == [1, 2, 3, 4]
    assert all(int(made) >= int(step) + 1 and off_main == "True"
               for step, made, off_main in seen), seen


def test_a_logged_row_waits_for_its_values_without_stopping_the_loop(tokenized, tmp_path,
                                                                     monkeypatch):
    """The loss and gradient norm of a logging row come back asynchronously
    (engine.reporting.readback): while they are in flight the loop runs the next step, and the row
    is emitted later with its own step and the values a synchronous read gives. A readback that
    never arrives on its own shows it: each row comes one step late, and the last at the end."""
    import engine.recipe.run
    import engine.reporting.readback

    params = {"logging.callbacks": ["overlap_cb:Order"]}
    now = _overlap_project(tokenized, tmp_path, "now", params)
    train_in_place(now)
    assert _seen(now) == ["end 1", "log 1", "end 2", "log 2", "end 3",
                                                "log 3", "end 4", "log 4"]

    class InFlight(engine.reporting.readback.Readback):
        def ready(self) -> bool:  # as a GPU copy still under way
            return False

    monkeypatch.setattr(engine.recipe.run, "Readback", InFlight)
    late = _overlap_project(tokenized, tmp_path, "late", params)
    train_in_place(late)
    assert _seen(late) == ["end 1", "end 2", "log 1", "end 3", "log 2",
                                                 "end 4", "log 3", "log 4"]
    assert losses(late) == losses(now) and logged_column(late, "grad_norm") == logged_column(now,
                                                                                "grad_norm")


def test_the_profiler_traces_the_scheduled_steps_and_keeps_earlier_traces(tokenized, tmp_path):
    """logging.profiler: wait 1, active 1, two cycles over 4 steps trace steps 2 and 4, each
    as a Chrome trace of the step's ops and an ops table by self time; the run computes
    exactly what it computes unprofiled. Another run over the same steps adds its files beside
    the first run's; a run too short for the schedule says it recorded nothing; a folder the
    traces cannot be written to, or one inside the run's DVC outputs, is refused before the
    run starts. (One-step windows: torch's parsing of a trace, for the ops table, is most of
    what profiling costs.)"""
    common = {**BASE, "eval.eval_steps": 0}
    plain, _ = train_here(tokenized, tmp_path / "plain", common)
    traced = {**common, "logging.profiler.enabled": True, "logging.profiler.warmup_steps": 0,
              "logging.profiler.active_steps": 1, "logging.profiler.num_cycles": 2,
              "logging.profiler.record_shapes": True, "logging.profiler.with_flops": True}
    project, proc = train_here(tokenized, tmp_path / "p", traced)
    assert losses(project) == losses(plain)
    assert all(torch.equal(a, b) for a, b in zip(adapter(project).values(),
                                                 adapter(plain).values()))
    out = project / "data/logs/profile"
    windows = ("step0000002-rank0", "step0000004-rank0")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{kind}-{w}.{ext}" for w in windows for kind, ext in (("trace", "json"), ("ops", "txt")))
    assert f"[train] profiler: step 2 traced to {out}/trace-{windows[0]}.json" in proc.stdout
    events = json.loads((out / f"trace-{windows[0]}.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "ProfilerStep#1" in names and not {"ProfilerStep#0", "ProfilerStep#2"} & names
    assert "aten::mm" in names and any("Input Dims" in e.get("args", {}) for e in events)
    table = (out / f"ops-{windows[0]}.txt").read_text()
    assert table.startswith("step 2, rank 0, sorted by self_cpu_time_total")
    assert "Self CPU" in table and "FLOPs" in table and "aten::mm" in table
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    write_params(project, {"logging.profiler.num_cycles": 1, "logging.profiler.wait_steps": 3})
    again = train_in_place(project)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in first} == first
    assert sorted(set(p.name for p in out.iterdir()) - set(first)) == [
        f"ops-{windows[1]}-2.txt", f"trace-{windows[1]}-2.json"]
    assert f"step 4 traced to {out}/trace-{windows[1]}-2.json" in again.stdout
    write_params(project, {"training.max_steps": 2})
    assert ("[train] profiler: nothing recorded: the run took 2 steps and the schedule records "
            "from its step 4 on") in train_in_place(project).stdout
    # a folder the traces cannot go to: one line from the train stage's check before launch
    from engine.preflight import check_before_launch
    from finetune.workspace import Workspace
    from tasks.launch import run_paths

    (tmp_path / "a-file").write_text("")
    write_params(project, {"logging.profiler.output_dir": str(tmp_path / "a-file/traces")})
    ws = Workspace.load(project / "params/default.yaml")
    with pytest.raises(PipelineError, match=r"^logging.profiler.output_dir: cannot write "
                       r"traces to .*/a-file/traces \(Not a directory\)$"):
        check_before_launch(ws.config, run_paths(ws))
    write_params(project, {"logging.profiler.output_dir": "data/checkpoints/traces"})
    ws = Workspace.load(project / "params/default.yaml")
    with pytest.raises(PipelineError, match=r"^logging.profiler.output_dir: .*data/checkpoints/"
                       r"traces is inside the run's output .*data/checkpoints, which every run rewrites"):
        check_before_launch(ws.config, run_paths(ws))
