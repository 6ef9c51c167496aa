"""The train stage on SLURM (`distributed.launcher: slurm`), on a real one-host cluster
(tests/slurm_cluster.py: munged, slurmctld, slurmd from Debian's packages).

The cluster tests (marker `slurm`) run in `make test-slow`, after .ci/run installs the
packages; the ones that need no cluster (the refusal without sbatch, the dry run) run in
`make test`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import slurm_cluster
from helpers import (BIN, adapter, copy_project, error_line, losses, run_cli, stage_outputs,
                     train_copy_here, write_params)

#: DDP over two processes, long enough that a signal lands mid-run
DDP = {"distributed.strategy": "ddp", "distributed.nproc_per_node": 2,
       "distributed.threads_per_process": 1, "training.max_steps": 30,
       "checkpoint.save_steps": 3, "eval.eval_steps": 15, "logging.logging_steps": 1}
ON_SLURM = {**DDP, "distributed.launcher": "slurm", "distributed.slurm.poll_seconds": 0.3}


def on_slurm(tokenized: Path, dest: Path, extra: dict | None = None) -> Path:
    shutil.copytree(tokenized, dest, symlinks=True)
    write_params(dest, {**ON_SLURM, **(extra or {})})
    return dest


# -- without a cluster ------------------------------------------------------------------------

def test_without_sbatch_the_stage_says_which_key_switches_back(tokenized, tmp_path):
    project = on_slurm(tokenized, tmp_path / "p")
    proc = run_cli(project, "stage", "train", env={"PATH": str(BIN)})
    line = error_line(proc)
    assert "sbatch is not on PATH" in line and "distributed.launcher: local" in line, line
    assert not (project / "data/trained").exists()
    assert not (project / "data/logs/slurm").exists()


def test_dry_run_shows_the_script_and_starts_nothing(tokenized, tmp_path):
    project = on_slurm(tokenized, tmp_path / "p", {
        "distributed.slurm.partition": "gpu", "distributed.slurm.time": "04:00:00",
        "distributed.slurm.gpus_per_node": 2, "distributed.slurm.cpus_per_task": 8,
        "distributed.slurm.extra_sbatch": ["#SBATCH --mail-type=END"],
        "distributed.slurm.setup": ["module load cuda/12.4"]})
    proc = run_cli(project, "stage", "train", "--dry-run", check=True)
    script = proc.stdout
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --gpus-per-node=2", "#SBATCH --partition=gpu",
                 "#SBATCH --time=04:00:00", "#SBATCH --requeue", "#SBATCH --signal=USR1@300",
                 "#SBATCH --mail-type=END", "module load cuda/12.4"):
        assert line in script.splitlines(), line
    assert "--cpus-per-task=16 --gpus-per-node=2" in script  # the node's one launcher task
    assert "-m torch.distributed.run" in script and "--rdzv_id=\"$SLURM_JOB_ID\"" in script
    assert not (project / "data/logs/slurm").exists()
    assert not (project / "data/trained").exists()
    bash = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr


# -- on the cluster -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    gone = slurm_cluster.missing()
    if gone and os.environ.get("FINETUNE_REQUIRE_SLURM") != "1":
        pytest.skip(f"no SLURM here ({', '.join(gone)} missing): {slurm_cluster.INSTALL}")
    assert not gone, f"FINETUNE_REQUIRE_SLURM=1 but {gone} are missing"
    old = os.environ.get("SLURM_CONF")
    with slurm_cluster.cluster(tmp_path_factory.mktemp("slurm")) as env:
        os.environ.update(env)
        yield env
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


class Stage:
    """`finetune stage train` running in the background, its output collected as it comes."""

    def __init__(self, project: Path):
        self.proc = subprocess.Popen([str(BIN / "finetune"), "stage", "train"], cwd=project,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.out.append(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out):
                found = re.search(pattern, line)
                if found:
                    return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.text}")

    def finish(self, timeout: float = 300) -> int:
        self.err = self.proc.stderr.read()
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    @property
    def text(self) -> str:
        return "".join(self.out)


def release_when_requeued(job: str, slurm: dict, timeout: float = 60) -> None:
    """A requeued job waits for its begin time (about two minutes on this SLURM): once it is
    pending again, let it start now. Not in the same second as the requeue: slurmd refuses a
    job whose credential is no newer than the revocation of its previous run's ("Job
    credential revoked"), which is what the begin time guards against."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = slurm_cluster.job_state(job, slurm)
        if int(state.get("Restarts", 0)) >= 1 and state.get("JobState") == "PENDING":
            time.sleep(2)
            slurm_cluster.scontrol("update", f"jobid={job}", "starttime=now", env=slurm)
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job} was not requeued: {state}")


@pytest.fixture(scope="module")
def through_slurm(tokenized, tmp_path_factory, slurm):
    """The DDP run through SLURM, uninterrupted, and its stage output."""
    project = on_slurm(tokenized, tmp_path_factory.mktemp("slurm-full") / "p")
    proc = run_cli(project, "stage", "train")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return project, proc


@pytest.mark.slurm
def test_ddp_through_slurm_equals_the_local_launch(tokenized, tmp_path, through_slurm):
    project, proc = through_slurm
    local, _ = train_copy_here(tokenized, tmp_path / "local", DDP)
    assert re.search(r"^\[train\] submitted SLURM job \d+ \(data/logs/slurm/train-", proc.stdout,
                     re.M), proc.stdout
    assert re.search(r"^\[slurm\] job \d+ RUNNING on \S+", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\[node 0\] \[train\] done", proc.stdout, re.M) or re.search(
        r"^\[node 0\] .*step", proc.stdout, re.M), proc.stdout
    ours, theirs = losses(project), losses(local)
    assert len(ours) == len(theirs) == 30
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-6
    a, b = adapter(project), adapter(local)
    assert all(torch.equal(a[k], b[k]) for k in a)
    run = next((project / "data/logs/slurm").iterdir())
    assert (run / "train.sbatch").read_text().startswith("#!/bin/bash")


def _interrupted_then_resumed(tokenized, tmp_path, slurm, through_slurm, interrupt) -> str:
    project = on_slurm(tokenized, tmp_path / "p")
    stage = Stage(project)
    job = stage.wait_for(r"submitted SLURM job (\d+)").group(1)
    stage.wait_for(r"^\[node 0\] \[train\] checkpoint")
    interrupt(job)
    release_when_requeued(job, slurm)
    code = stage.finish()
    assert code == 0, stage.text + stage.err
    assert re.search(rf"^\[slurm\] job {job} RUNNING on \S+, restart 1", stage.text, re.M), \
        stage.text
    full, _ = through_slurm
    a, b = adapter(full), adapter(project)
    assert all(torch.equal(a[k], b[k]) for k in a), "the requeued run ended elsewhere"
    assert losses(project) == losses(full)
    return stage.text


@pytest.mark.slurm
def test_scontrol_requeue_resumes_from_the_checkpoint_bitwise(tokenized, tmp_path, slurm,
                                                             through_slurm):
    text = _interrupted_then_resumed(
        tokenized, tmp_path, slurm, through_slurm,
        lambda job: slurm_cluster.scontrol("requeue", job, env=slurm))
    assert re.search(r"^\[node 0\] .*resumed from", text, re.M), text


@pytest.mark.slurm
def test_the_signal_before_the_time_limit_saves_stops_and_requeues(tokenized, tmp_path, slurm,
                                                                   through_slurm):
    """SLURM's `--signal=USR1@N`, sent by hand: every process of the step gets it."""
    text = _interrupted_then_resumed(
        tokenized, tmp_path, slurm, through_slurm,
        lambda job: subprocess.run(["scancel", "--signal=USR1", job], check=True,
                                   env={**os.environ, **slurm}))
    assert re.search(r"^\[node 0\] \[train\] stopped at step \d+ on SIGUSR1", text, re.M), text
    assert re.search(r"^\[slurm\] stopped before the time limit", text, re.M), text
    assert re.search(r"^\[node 0\] .*resumed from", text, re.M), text


@pytest.mark.slurm
def test_scancel_from_outside_ends_the_stage_in_one_line(tokenized, tmp_path, slurm):
    project = on_slurm(tokenized, tmp_path / "p")
    before = stage_outputs(project)
    stage = Stage(project)
    job = stage.wait_for(r"submitted SLURM job (\d+)").group(1)
    stage.wait_for(r"^\[node 0\] ")
    subprocess.run(["scancel", job], check=True, env={**os.environ, **slurm})
    code = stage.finish()
    assert code == 1, stage.text + stage.err
    last = stage.err.strip().splitlines()[-1]
    assert last.startswith(f"error: SLURM job {job} ended CANCELLED"), stage.err
    assert not (project / "data/trained").exists()
    assert {k: v for k, v in stage_outputs(project).items() if "checkpoint" not in k} == {
        k: v for k, v in before.items() if "checkpoint" not in k}


@pytest.mark.slurm
def test_a_job_slurm_refuses_is_one_line_with_slurms_reason(tokenized, tmp_path, slurm):
    project = on_slurm(tokenized, tmp_path / "p", {"distributed.slurm.partition": "nosuch"})
    before = stage_outputs(project)
    proc = run_cli(project, "stage", "train")
    line = error_line(proc)
    assert line.startswith("error: SLURM refused the train job"), line
    assert "invalid partition" in line.lower() and "distributed.slurm" in line, line
    assert stage_outputs(project) == before


@pytest.mark.slurm
def test_ctrl_c_in_the_stage_cancels_the_job(tokenized, tmp_path, slurm):
    project = on_slurm(tokenized, tmp_path / "p")
    stage = Stage(project)
    job = stage.wait_for(r"submitted SLURM job (\d+)").group(1)
    stage.wait_for(r"^\[node 0\] ")
    stage.proc.send_signal(signal.SIGINT)
    code = stage.finish()
    assert code == 130, stage.text + stage.err
    assert f"[slurm] cancelled job {job}" in stage.err, stage.err
    assert stage.err.strip().splitlines()[-1].startswith(
        "error: stage train interrupted (SIGINT)"), stage.err
    deadline = time.monotonic() + 30
    while slurm_cluster.job_state(job, slurm).get("JobState") != "CANCELLED":
        assert time.monotonic() < deadline, slurm_cluster.job_state(job, slurm)
        time.sleep(0.2)
    assert not (project / "data/trained").exists()


@pytest.mark.slurm
def test_the_flow_trains_on_the_cluster_and_runs_the_other_stages_where_it_is(tmp_path, slurm):
    """The nightly flow's train task is the same stage: its job runs on the cluster, its log
    lines reach the flow run's log in Prefect, the other stages run in the flow's process."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker
    from prefect.testing.utilities import prefect_test_harness

    from flows.finetune import finetune

    project = copy_project(tmp_path / "p", {"distributed.launcher": "slurm",
                                            "distributed.slurm.poll_seconds": 0.3})
    with prefect_test_harness(server_startup_timeout=120):
        state = finetune(workspace=str(project), return_state=True)
        assert state.is_completed(), state
        APILogWorker.drain_all(timeout=30)  # the flow's queued log lines reach the server
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
                any_=[state.state_details.flow_run_id])))
    lines = [log.message for log in logs]
    assert any(re.search(r"submitted SLURM job \d+", line) for line in lines), lines
    assert any(line.startswith("[node 0] [train]") for line in lines), lines
    assert (project / "data/export").is_dir()
    lock = (project / "dvc.lock").read_text()
    assert "train:" in lock and "export:" in lock


@pytest.mark.slurm
def test_a_job_left_by_a_killed_stage_keeps_a_second_one_out(tokenized, tmp_path, slurm):
    """The job outlives a killed stage (it trains on, as a SLURM job should); a new stage in
    the project refuses to submit a second job that would write the same outputs."""
    project = on_slurm(tokenized, tmp_path / "p")
    stage = Stage(project)
    job = stage.wait_for(r"submitted SLURM job (\d+)").group(1)
    stage.wait_for(r"^\[node 0\] ")
    stage.proc.kill()
    stage.finish()
    line = error_line(run_cli(project, "stage", "train"))
    assert f"SLURM job {job} of an earlier train stage is still RUNNING" in line, line
    assert f"scancel {job}" in line, line
    subprocess.run(["scancel", job], check=True, env={**os.environ, **slurm})
