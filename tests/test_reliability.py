"""Nothing stale resumes: a checkpoint continues only the run that wrote it (its fingerprint).

Each test here failed on the code before checkpoints carried a fingerprint: a resume with a
changed learning rate gave the old run's weights, and the retry of a new run that crashed
before its first checkpoint resumed the previous run's last one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    adapter,
    error_line,
    kill_train_stage_when,
    losses,
    refused_here,
    resume_cut_back,
    run_cli,
    stage_outputs,
    train_here,
    train_in_place,
    wait_until_no_process_in,
    write_params,
)

from finetune.errors import PipelineError
from tasks.train import RESUME_ENV

NEW_LR = {"optimizer.learning_rate": 0.002}
DDP2 = {"distributed.strategy": "ddp", "distributed.nproc_per_node": 2}


def _bitwise_equal(a: Path, b: Path) -> bool:
    x, y = adapter(a), adapter(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_explicit_resume_refuses_a_checkpoint_of_other_params(tokenized, tmp_path):
    """A finished run, then a new learning rate with resume_from_checkpoint: true: one line
    naming the key, the checkpoint and the ways out; nothing written. Listing the key in
    resume_ignore_changes is the user's way to continue anyway."""
    project, _ = train_here(tokenized, tmp_path / "p")
    before = stage_outputs(project)
    write_params(project, {**NEW_LR, "checkpoint.resume_from_checkpoint": True})
    # the train stage in this process: it refuses before any training, in one line (the
    # CLI's exit 2 and error: line for it are test_cli's)
    line = refused_here(project, "train")
    assert "step-0000006 belongs to another run" in line, line
    assert "optimizer.learning_rate: 0.005 -> 0.002" in line, line
    assert "resume_ignore_changes" in line and "auto" in line, line
    assert stage_outputs(project) == before
    write_params(project, {"checkpoint.resume_ignore_changes": ["optimizer.learning_rate"]})
    assert "resumed from" in train_in_place(project).stdout


def test_auto_resume_starts_fresh_on_another_runs_checkpoint(tokenized, tmp_path):
    """resume_from_checkpoint: auto (what a retry uses) with the old run's checkpoints in the
    folder trains the new params from scratch, exactly as a fresh run of them; the old
    checkpoints are moved aside, not mixed with the new ones."""
    expected, _ = train_here(tokenized, tmp_path / "expected", NEW_LR)
    project, _ = train_here(tokenized, tmp_path / "p")
    write_params(project, {**NEW_LR, "checkpoint.resume_from_checkpoint": "auto"})
    out = train_in_place(project).stdout
    assert "belongs to another run (optimizer.learning_rate: 0.005 -> 0.002)" in out, out
    assert "resumed from" not in out
    assert _bitwise_equal(project, expected) and losses(project) == losses(expected)
    (moved,) = (project / "data/checkpoints.previous").iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["step-0000003", "step-0000006"]
    assert sorted(p.name for p in (project / "data/checkpoints").iterdir()) == [
        "step-0000003", "step-0000006"]


def test_a_new_run_killed_before_its_first_checkpoint_is_retried_fresh(tokenized, tmp_path):
    """The old run finished (checkpoints at 3 and 6); the new run (new learning rate) is
    killed at step 2, before it saved anything; the orchestrator's retry must not continue
    the old run's step 6 but train the new run, ending bitwise like its uninterrupted run."""
    expected, _ = train_here(tokenized, tmp_path / "expected", NEW_LR)
    project, _ = train_here(tokenized, tmp_path / "p")
    write_params(project, NEW_LR)
    before = _checkpoints_and_model(project)
    kill_train_stage_when(project, lambda line: line.startswith("[train] step=2 "))
    wait_until_no_process_in(project)
    # the old run's checkpoints and model stay where they were (they used to be moved aside
    # at start-up, leaving data/checkpoints empty and the workspace DVC-dirty)
    assert _checkpoints_and_model(project) == before
    proc = run_cli(project, "stage", "train", check=True, env={RESUME_ENV: "1"})
    assert "resumed from" not in proc.stdout, proc.stdout
    assert _bitwise_equal(project, expected) and losses(project) == losses(expected)


def _checkpoints_and_model(project: Path) -> dict[str, str]:
    return {k: v for k, v in stage_outputs(project).items()
            if k.startswith(("data/checkpoints/", "data/trained/"))}


def test_ctrl_c_before_the_first_checkpoint_offers_no_earlier_runs_checkpoint(tokenized,
                                                                              tmp_path):
    """A new run (new learning rate) stopped with Ctrl-C at step 2, before its first
    checkpoint: the line says it has none yet and how to start again (it used to offer the
    earlier run's checkpoint, which the resume it named then refused), and the earlier run's
    checkpoints and model are where they were."""
    import os
    import signal
    import subprocess

    from helpers import BIN

    project, _ = train_here(tokenized, tmp_path / "p")
    write_params(project, NEW_LR)
    before = _checkpoints_and_model(project)
    stage = subprocess.Popen([str(BIN / "finetune"), "stage", "train"], cwd=project,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    for line in stage.stdout:
        if line.startswith("[train] step=2 "):
            break
    os.killpg(stage.pid, signal.SIGINT)
    _, err = stage.communicate(timeout=60)
    assert stage.returncode == 130, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    # the step the stage last heard of: the relay may lag the worker's own step=2 line
    assert re.fullmatch(
        r"error: stage train interrupted \(SIGINT\); reached step [12]; no checkpoint of "
        r"this run yet \(data/checkpoints keeps an earlier run's, untouched\); start "
        r"again with: finetune stage train \(checkpoint.save_steps sets how often one "
        r"is written\)", line), line
    wait_until_no_process_in(project)
    assert _checkpoints_and_model(project) == before


def test_keys_outside_the_fingerprint_do_not_block_a_resume(tokenized, tmp_path):
    """Bookkeeping and speed keys may change between a crash and its resume: still exact."""
    full, _ = train_here(tokenized, tmp_path / "full")

    def resume_with_other_bookkeeping(project: Path):
        write_params(project, {"checkpoint.save_total_limit": 5, "eval.eval_batches": 2,
                               "training.per_device_eval_batch_size": 4})
        return train_in_place(project)

    resume_cut_back(full, tmp_path, 3, resume_with_other_bookkeeping)


def test_fingerprint_follows_data_and_model_content_not_their_paths(tokenized, tmp_path):
    from engine.state import fingerprint
    from finetune.config import load_config
    from finetune.config.fingerprint import counts

    cfg = load_config(tokenized / "params/default.yaml")
    model = tokenized / cfg.model.name_or_path
    data = tokenized / "data/tokenized/train"
    base = fingerprint.compute(cfg, data, str(model))
    moved_model, moved_data = tmp_path / "model", tmp_path / "train"
    shutil.copytree(model, moved_model)
    shutil.copytree(data, moved_data)
    assert fingerprint.compute(cfg, moved_data, str(moved_model)) == base  # paths do not count
    weights = next(moved_model.glob("*.safetensors"))
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    arrow = next(moved_data.rglob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes() + b"\0")
    changed = fingerprint.differences(base, fingerprint.compute(cfg, moved_data, str(moved_model)))
    assert changed == {"train_data": "content changed", "base_model": "content changed"}
    assert counts("optimizer.learning_rate") and counts("data.max_seq_length")
    assert counts("distributed.fsdp.param_dtype")
    assert not counts("training.torch_compile_mode") and not counts("data.dataset_name")
    assert not counts("distributed.rdzv_endpoint") and not counts("logging.logging_steps")


def test_resume_ignore_changes_names_only_fingerprint_keys():
    from finetune.config import validate_raw
    from finetune.errors import PipelineError

    data = {"dataset_name": "gsm8k"}
    validate_raw({"data": data, "checkpoint": {
        "resume_ignore_changes": ["training.max_steps", "train_data"]}})
    with pytest.raises(PipelineError, match="'logging.logging_steps' is not part of the checkpoint"):
        validate_raw({"data": data,
                      "checkpoint": {"resume_ignore_changes": ["logging.logging_steps"]}})


def test_resume_that_cannot_reshard_is_refused_before_torchrun_starts(tokenized, tmp_path):
    """The checkpoint's meta.json says one process. Two DiLoCo workers cannot continue it
    (DiLoCo's per-worker state is not resharded), and two DDP ranks with the same
    micro-batch would double the global batch: the stage refuses either in one line before
    it starts any process (observed with an audit hook on subprocess.Popen)."""
    import sys

    from finetune.workspace import Workspace
    from tasks.train import train

    project, _ = train_here(tokenized, tmp_path / "p")
    launched, watching = [], [True]

    def audit(event, args):
        if watching[0] and event == "subprocess.Popen":
            launched.append(args[1])

    sys.addaudithook(audit)
    diloco = {"distributed.strategy": "diloco", "distributed.nproc_per_node": 2,
              "distributed.diloco.inner_steps": 3, "distributed.diloco.diloco_loops": 2}
    try:
        for params, refusal in (
                (diloco, "world size 1 but this run is diloco with world size 2; diloco resumes "
                         "only with the strategy and world size that wrote it"),
                ({**DDP2, "distributed.diloco": None},
                 r"has global batch 4 \(per_device_train_batch_size 4 x "
                 r"gradient_accumulation_steps 1 x world size 1\); this run's is 8 .*: "
                 "set training.per_device_train_batch_size 2 to resume$")):
            write_params(project, {**params, "checkpoint.resume_from_checkpoint": True})
            with pytest.raises(PipelineError, match=refusal):
                train(Workspace.load(project / "params/default.yaml"))
    finally:
        watching[0] = False
    assert launched == []


HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from finetune.workspace import workspace_lock
with workspace_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_stage_command_beside_another_run_is_refused_as_busy(tokenized, tmp_path):
    """Every command that writes a stage's outputs takes the workspace lock: `finetune stage`
    run beside another run (here a process holding the lock, as `finetune run`, the flow or
    another stage would) fails with the busy line and writes nothing; once the holder is gone
    (killed: the kernel drops its lock) the same command runs. Commands started under a
    holder (finetune run -> dvc repro -> finetune stage) run under its lock: the pipeline
    tests cover that path."""
    import hashlib
    import subprocess
    import sys

    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)

    def formatted() -> dict:
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((project / "data/formatted").rglob("*")) if p.is_file()}

    before = formatted()
    # what a kill during a final write leaves: removed by the next stage, never while the
    # lock's holder (which may own it) is alive
    leftovers = [project / "data/.trained.tmp-k1ll3d", project / "data/.trained.old-4242"]
    for path in leftovers:
        (path / "part").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(project)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = error_line(run_cli(project, "stage", "format"))
        assert "is busy: another pipeline run holds" in line and str(project) in line
        assert formatted() == before and all(p.is_dir() for p in leftovers)
    finally:
        holder.kill()
        holder.wait()
    proc = run_cli(project, "stage", "format", check=True)
    assert "[format] done" in proc.stdout
    assert not any(p.exists() for p in leftovers)
    assert "removed data/.trained.tmp-k1ll3d, left by an interrupted write" in proc.stdout


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_stage_says_where_it_stopped_and_how_to_resume(tokenized, tmp_path,
                                                                      how):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or a scheduler's
    SIGTERM to the stage: exit 130 / 143 (128 + the signal) and one line with the step
    reached, the newest checkpoint and the resume command, no traceback; the workers are gone.
    A second `finetune stage train` started while the first runs is refused as busy (exit 2)
    and leaves the first's checkpoints as they are."""
    import os
    import signal
    import subprocess

    from helpers import BIN

    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    write_params(project, {"training.max_steps": 500, "checkpoint.save_steps": 2,
                           "checkpoint.save_total_limit": 3, "logging.logging_steps": 1})
    stage = subprocess.Popen([str(BIN / "finetune"), "stage", "train"], cwd=project,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    for line in stage.stdout:
        if line.startswith("[train] checkpoint"):
            break
    if how == "ctrl-c":  # a second training on the workspace meanwhile: refused, writes nothing
        second = run_cli(project, "stage", "train", "-s", "optimizer.learning_rate=0.001")
        assert "is busy: another pipeline run holds" in error_line(second, code=2)
        assert stage.poll() is None, "the first training still runs"
        os.killpg(stage.pid, signal.SIGINT)
    else:
        stage.send_signal(signal.SIGTERM)
    out, err = stage.communicate(timeout=60)
    assert stage.returncode == (130 if how == "ctrl-c" else 143), (out, err)
    assert "Traceback" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    assert line.startswith(f"error: stage train interrupted ({name}); reached step "), line
    assert "; last checkpoint data/checkpoints/step-" in line
    assert line.endswith("resume with: finetune stage train -s "
                         "checkpoint.resume_from_checkpoint=true"), line
    wait_until_no_process_in(project)
    assert not (project / "data/trained").exists()
    # the checkpoint it names is the first training's, whole (the refused one wrote none)
    from engine.state.checkpoint import is_valid, read_meta

    named = project / line.split("; last checkpoint ")[1].split(" (step")[0]
    assert is_valid(named)
    assert read_meta(named)["fingerprint"]["config"]["optimizer.learning_rate"] == 0.005


def _files(folder: Path) -> dict[str, bytes]:
    if folder.is_file():
        return {folder.name: folder.read_bytes()}
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_same_run_twice_writes_the_same_bytes(tokenized, tmp_path):
    """DVC hashes data/trained, git keeps the metrics and plots, and an exact resume is
    checked against the checkpoints, so a rerun of an unchanged checkout must write them byte
    for byte (checkpoints carried the save time and wall-clock rows: 3369287 vs 3369289
    bytes). Two projects in two folders: no
    absolute path either. The timings go to data/logs, outside DVC and git."""
    import json

    a, _ = train_here(tokenized, tmp_path / "a")
    b, _ = train_here(tokenized, tmp_path / "b")
    assert sorted(p.name for p in (a / "data/checkpoints").iterdir())  # something to compare
    for rel in ("data/checkpoints", "data/trained", "data/metrics/train.json",
                "data/plots/train.csv", "data/plots/eval.csv"):
        x, y = _files(a / rel), _files(b / rel)
        assert x.keys() == y.keys() and [k for k in x if x[k] != y[k]] == [], rel
    timings = json.loads((a / "data/logs/train_timings.json").read_text())
    assert timings["train_runtime"] > 0 and timings["memory_rss_mb"] > 0
    assert not set(timings) & set(json.loads((a / "data/metrics/train.json").read_text()))
