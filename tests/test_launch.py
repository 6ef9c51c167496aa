"""The train stage's launch handshake (tasks/launch.py): torchrun starts before the stage's
checks, so a failing check must stop it before rank 0 wrote anything; rank 0's logged rows
reach the stage through the row relay."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, wait_until_no_process_in, write_params

from finetune.errors import PipelineError
from finetune.workspace import Workspace
from tasks.launch import RowTail


def test_row_tail_relays_whole_lines_in_order_and_keeps_the_first_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("")
    seen = []
    tail = RowTail(path, seen.append)
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
    tail = RowTail(path, failing)
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


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_killing_the_stage_process_group_stops_every_worker(tokenized, tmp_path, nproc):
    """What a scheduler's cancel, a CI timeout or `kill -- -PGID` does: SIGKILL to the train
    stage's process group mid-training. torchrun starts its workers in sessions of their own;
    within 5 s none of them may be alive, and nothing under data/ may change afterwards."""
    import signal
    import subprocess

    from helpers import BIN, write_params

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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_orchestrator_task_takes_its_training_with_it(tokenized, tmp_path, sig):
    """The Prefect task runs `dvc repro` (which runs the stage, which runs torchrun): SIGTERM
    to the task's process (a cancel) is forwarded to the whole job, and SIGKILL ends it by the
    chain of parent-death signals. Before, dvc and the stage under it trained on."""
    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    # a run that prints nothing after its start, so no broken pipe ends it either
    write_params(project, {"training.max_steps": 600, "logging.logging_steps": 1000,
                           "logging.disable_tqdm": True, "checkpoint.save_strategy": "no",
                           "eval.eval_strategy": "no"})
    runner = subprocess.Popen(
        [sys.executable, "-c", "from pathlib import Path; from flows.dvc_runner import "
         "repro_stage; repro_stage(Path('.'), 'train', on_line=print)"],
        cwd=project, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        # dvc runs a stage's cmd as `$SHELL -c cmd`; dash (Debian's /bin/sh, and the shell when
        # SHELL is unset) stays as the stage's parent where bash execs: one more link
        env={**os.environ, "SHELL": "/bin/sh"})
    for line in runner.stdout:
        if " trainable / " in line:  # training has started
            break
    else:
        raise AssertionError("the stage ended before training started")
    time.sleep(1.0)
    runner.send_signal(sig)
    runner.wait(timeout=60)
    wait_until_no_process_in(project)
    assert not (project / "data/trained").exists()


def test_watchdog_ends_a_process_whose_watched_pid_is_gone(tmp_path):
    """The parent-death fallback where the kernel has none (macOS, Windows), run here."""
    watched = subprocess.Popen(["sleep", "60"])
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, time; from engine.process.lifetime import start_watchdog; "
        f"start_watchdog(os.getppid(), [{watched.pid}], interval=0.1); time.sleep(60)")],
        cwd=ROOT)
    time.sleep(1.0)
    assert child.poll() is None
    watched.kill()
    watched.wait()
    assert child.wait(timeout=5) == -signal.SIGKILL
