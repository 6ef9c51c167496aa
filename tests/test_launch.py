"""The train stage's launch handshake (tasks/launch.py): torchrun starts before the stage's
checks, so a failing check must stop it before rank 0 wrote anything; rank 0's logged rows
reach the stage through the row relay."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest

from finetune.errors import PipelineError
from finetune.workspace import Workspace
from tasks.launch import _RowTail


def test_row_tail_relays_whole_lines_in_order_and_keeps_the_first_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("")
    seen = []
    tail = _RowTail(path, seen.append)
    with open(path, "a") as fh:
        fh.write('{"step": 1, "loss": 2.5}\n{"step": 2, ')  # a row cut mid-write
        fh.flush()
        time.sleep(0.5)
        fh.write('"loss": 2.25}\n{"step": 3, "loss": 2.0}\n')
    assert tail.finish() is None
    assert seen == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}, {"step": 3, "loss": 2.0}]

    def failing(row):
        if row["step"] == 2:
            raise ConnectionError("tracking server down")
        seen.append(row)

    seen.clear()
    tail = _RowTail(path, failing)
    error = tail.finish()
    assert isinstance(error, ConnectionError) and seen == [{"step": 1, "loss": 2.5}]


def test_failing_check_stops_the_started_job_before_it_writes(tokenized, tmp_path, monkeypatch):
    """The check fails only after the worker reached the point where it would start writing
    (its ready file): no file under data/ may change or appear, the error is the
    check's own, and no torchrun process is left."""
    import tasks.train as train_stage

    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    before = {p: p.read_bytes() for p in (project / "data").rglob("*") if p.is_file()}
    seen_worker = threading.Event()

    def slow_failing_check(ws):
        """Fails only once rank 0 is ready to write: it loaded model and data and now waits
        for the stage's go (the job's ready file)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not seen_worker.is_set():
            for kid in psutil.Process().children(recursive=True):
                cmd = _cmdline(kid)
                if "engine.worker" in cmd and "torch.distributed.run" not in cmd:
                    ready = Path(cmd[-1]).with_name("ready")
                    if ready.exists():
                        seen_worker.set()
            time.sleep(0.1)
        raise PipelineError("training.example: the check failed")

    monkeypatch.setattr(train_stage, "preflight", slow_failing_check)
    ws = Workspace.load(project / "params/default.yaml")
    with pytest.raises(PipelineError, match="training.example: the check failed"):
        train_stage.train(ws)
    assert seen_worker.is_set(), "the worker never got ready: the test proves nothing"
    after = {p: p.read_bytes() for p in (project / "data").rglob("*") if p.is_file()}
    assert after == before, "the aborted job wrote or changed files"
    left = [k for k in psutil.Process().children(recursive=True) if _is_job(k)]
    assert not left, f"processes of the aborted job still running: {left}"


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.NoSuchProcess:
        return []


def _is_job(proc: psutil.Process) -> bool:
    return "engine.worker" in " ".join(_cmdline(proc))


@pytest.mark.parametrize("nproc", [1, 2])
def test_killing_the_stage_process_group_stops_every_worker(tokenized, tmp_path, nproc):
    """What a scheduler's cancel, a CI timeout or `kill -- -PGID` does: SIGKILL to the train
    stage's process group mid-training. torchrun starts its workers in sessions of their own;
    within 5 s none of them may be alive, and nothing under data/ may change afterwards."""
    import os
    import signal
    import subprocess

    from conftest import BIN, write_params

    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    write_params(project, {"training.max_steps": 500, "checkpoint.save_total_limit": 500,
                           "distributed.nproc_per_node": nproc,
                           "distributed.strategy": "ddp" if nproc > 1 else "single"})
    stage = subprocess.Popen([str(BIN / "finetune"), "stage", "train"], cwd=project,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    for line in stage.stdout:
        if line.startswith("[train] step="):  # training under way (logging every step)
            break
    workers = [k for k in psutil.Process(stage.pid).children(recursive=True)
               if _is_job(k) and "torch.distributed.run" not in _cmdline(k)]
    assert len(workers) == nproc, workers
    os.killpg(stage.pid, signal.SIGKILL)
    stage.wait(timeout=30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "workers outlived their stage"
    before = {p: p.stat().st_mtime_ns for p in (project / "data").rglob("*") if p.is_file()}
    time.sleep(2)
    after = {p: p.stat().st_mtime_ns for p in (project / "data").rglob("*") if p.is_file()}
    assert after == before, "files under data/ changed after the stage was killed"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
