"""Save and stop on a scheduler's signal (engine.process.preemption): the job names a signal;
on it every rank saves a normal checkpoint at the next step end and leaves with exit 0, the
main rank writes the stopped file, and a restart with resume auto ends bitwise equal to a run
never stopped. The signal is sent as a batch script's scheduler does: to one worker of a
torchrun that ignores it itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from helpers import adapter, as_a_worker, losses, write_params

#: SignalAt sends this process the stop signal at the step named in signal_at.txt (0: before
#: the first step). HoldAfterStep3 keeps the main rank at the end of step 3 while a file "hold"
#: exists, so a signal sent once step 2's row shows lands before the last step however late
#: the test gets to send it. (Files, so the run stopped and the run never stopped have the same
#: params and fingerprint.)
SIGNALLER = """
import os
import signal
import time
from pathlib import Path


class HoldAfterStep3:
    def on_step_end(self, state):
        deadline = time.monotonic() + 60
        while state.step == 3 and Path("hold").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


class SignalAt:
    def _at(self, step):
        if int(Path("signal_at.txt").read_text()) == step:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_train_begin(self, state):
        self._at(0)

    def on_step_end(self, state):
        self._at(state.step)
"""

SINGLE = {"training.max_steps": 4, "checkpoint.save_strategy": "no", "eval.eval_steps": 4,
          "logging.logging_steps": 1, "logging.callbacks": ["signal_cb:SignalAt"]}

DDP = {"distributed.strategy": "ddp", "distributed.nproc_per_node": 2,
       "distributed.threads_per_process": 1, "training.max_steps": 8,
       "checkpoint.save_strategy": "no", "eval.eval_steps": 8, "logging.logging_steps": 1,
       "logging.callbacks": ["signal_cb:HoldAfterStep3"],
       # a rank left waiting in a collective fails the run in a minute, not half an hour
       "distributed.ddp_timeout": 60}


def job_file(project: Path, stopped: Path, name: str = "job.json") -> Path:
    """The job the train stage would hand torchrun, armed for SIGUSR1."""
    from finetune.workspace import Workspace
    from tasks.launch import job_spec

    job = job_spec(Workspace.load(project / "params/default.yaml"), stop_signal="SIGUSR1",
                   stopped_file=str(stopped))
    return job.write(project / name)


def run_job_here(project: Path, stopped: Path, signal_at: int):
    from engine.process.job import JobSpec
    from engine.worker import run_job

    (project / "signal_at.txt").write_text(str(signal_at))
    job = JobSpec.read(job_file(project, stopped))
    with as_a_worker(project) as out:
        run_job(job)
    return out.getvalue()


def same_weights(a: Path, b: Path) -> None:
    x, y = adapter(a), adapter(b)
    assert x.keys() == y.keys()
    assert all(torch.equal(x[k], y[k]) for k in x), "resumed weights differ from never stopped"


# -- one process, in this process ------------------------------------------------------------

@pytest.fixture(scope="module")
def single(tokenized, tmp_path_factory):
    """A 4-step run, with a stale stopped file beforehand and the signal at its last step
    (it just finishes): the run never stopped."""
    project = tmp_path_factory.mktemp("single") / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "signal_cb.py").write_text(SIGNALLER)
    write_params(project, SINGLE)
    stopped = project / "stopped.json"
    stopped.write_text('{"step": 1, "checkpoint": "old", "signal": "SIGUSR1"}')
    run_job_here(project, stopped, signal_at=4)
    return project


def test_a_signal_at_the_last_step_finishes_and_a_stale_stopped_file_goes(single):
    assert not (single / "stopped.json").exists()
    assert (single / "data/trained/adapter_model.safetensors").exists()
    assert json.loads((single / "data/metrics/train.json").read_text())["global_step"] == 4
    assert not (single / "data/checkpoints").exists() or not any(
        (single / "data/checkpoints").iterdir())


def test_a_signal_saves_a_checkpoint_the_params_did_not_ask_for_and_stops(single, tmp_path):
    from engine.process.preemption import StoppedBySignal

    project = tmp_path / "cut"
    shutil.copytree(single, project, symlinks=True)
    for made in ("data/trained", "data/metrics", "data/plots", "data/checkpoints"):
        shutil.rmtree(project / made, ignore_errors=True)
    (project / "data/logs/train_timings.json").unlink(missing_ok=True)
    stopped = project / "stopped.json"
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(StoppedBySignal) as caught:
        run_job_here(project, stopped, signal_at=2)
    checkpoint = project / "data/checkpoints/step-0000002"
    assert str(caught.value) == (f"[train] stopped at step 2 on SIGUSR1: checkpoint {checkpoint} "
                                 "saved; a restart resumes from it")
    assert json.loads(stopped.read_text()) == {"step": 2, "checkpoint": str(checkpoint),
                                               "signal": "SIGUSR1"}
    assert [p.name for p in (project / "data/checkpoints").iterdir()] == ["step-0000002"]
    assert not (project / "data/trained").exists()
    assert not (project / "data/metrics/train.json").exists()
    assert signal.getsignal(signal.SIGUSR1) == before  # the handler is given back
    # the requeued job: resume auto continues the stop checkpoint and ends as if never stopped
    write_params(project, {"checkpoint.resume_from_checkpoint": "auto"})
    out = run_job_here(project, stopped, signal_at=-1)
    assert f"resumed from {checkpoint} at step 2" in out
    assert not stopped.exists()
    same_weights(single, project)


def test_a_signal_before_the_first_step_is_kept_and_acted_on_after_it(single, tmp_path):
    from engine.process.preemption import StoppedBySignal

    project = tmp_path / "early"
    shutil.copytree(single, project, symlinks=True)
    shutil.rmtree(project / "data/trained")
    with pytest.raises(StoppedBySignal, match="stopped at step 1 on SIGUSR1"):
        run_job_here(project, project / "stopped.json", signal_at=0)
    assert json.loads((project / "stopped.json").read_text())["step"] == 1
    assert not (project / "data/trained").exists()


def test_the_job_fields_node_rank_env_and_a_bad_signal_name(monkeypatch, tmp_path):
    from engine.process.job import JobSpec, RunPaths
    from engine.process.preemption import signal_number
    from engine.worker import job_config
    from finetune.errors import PipelineError

    paths = RunPaths(tmp_path, None, None, tmp_path, tmp_path, tmp_path, tmp_path)
    job = JobSpec(config={"distributed": {"nnodes": 2, "node_rank": 0}}, paths=paths,
                  stop_signal="SIGUSR1", stopped_file="stopped.json",
                  node_rank_env="SCHED_NODE")
    assert JobSpec.read(job.write(tmp_path / "job.json")) == job  # the fields round-trip
    monkeypatch.setenv("SCHED_NODE", "1")
    assert job_config(job)["distributed"] == {"nnodes": 2, "node_rank": 1}
    assert job.config["distributed"]["node_rank"] == 0  # the job itself is not changed
    monkeypatch.setenv("SCHED_NODE", "x")
    with pytest.raises(PipelineError, match="environment variable SCHED_NODE is 'x'"):
        job_config(job)
    monkeypatch.delenv("SCHED_NODE")
    with pytest.raises(PipelineError, match="SCHED_NODE is unset"):
        job_config(job)
    with pytest.raises(PipelineError, match="job stop_signal 'SIGNOPE' is not a signal"):
        signal_number("SIGNOPE")
    assert signal_number("USR1") is signal.SIGUSR1


# -- two processes under torchrun, the signal to one of them ----------------------------------

def torchrun(project: Path, job: Path) -> subprocess.Popen:
    """As a batch script starts it: torchrun ignores the signal, its workers act on it."""
    from finetune.workspace import Workspace
    from tasks.launch import torchrun_command

    cmd = " ".join(torchrun_command(Workspace.load(project / "params/default.yaml"), job))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(project), *filter(None, [os.environ.get("PYTHONPATH")])]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(["bash", "-c", f'trap "" USR1; exec {cmd}'], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def ended(agent: subprocess.Popen, seen: str = "") -> str:
    """What torchrun printed, once it exited 0; a run that hangs is killed and fails."""
    try:
        out = seen + agent.communicate(timeout=150)[0]
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)  # the workers die with the agent
        raise AssertionError(seen + agent.communicate()[0]) from None
    assert agent.returncode == 0, out
    return out


def worker_of_rank(agent: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    raise AssertionError(f"no worker of rank {rank} under torchrun")


@pytest.fixture(scope="module")
def ddp_full(tokenized, tmp_path_factory):
    """The 2-process run never stopped (started here, waited for by the test that needs it)."""
    project = tmp_path_factory.mktemp("ddp") / "full"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "signal_cb.py").write_text(SIGNALLER)
    write_params(project, DDP)
    agent = torchrun(project, job_file(project, project / "stopped.json"))
    yield project, agent
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


@pytest.mark.distributed
def test_ddp_one_rank_signalled_stops_all_and_a_restart_resumes_bitwise(ddp_full, tokenized,
                                                                           tmp_path):
    project = tmp_path / "cut"
    shutil.copytree(tokenized, project, symlinks=True)
    (project / "signal_cb.py").write_text(SIGNALLER)
    (project / "hold").touch()
    write_params(project, DDP)
    stopped = project / "stopped.json"
    agent = torchrun(project, job_file(project, stopped))
    seen = ""
    for line in agent.stdout:
        seen += line
        if line.startswith("[train] step=2 "):
            worker_of_rank(agent, 1).send_signal(signal.SIGUSR1)
            (project / "hold").unlink()
            break
    seen = ended(agent, seen)
    record = json.loads(stopped.read_text())
    step, checkpoint = record["step"], Path(record["checkpoint"])
    assert 2 <= step <= 3 and record["signal"] == "SIGUSR1"  # the held step at the latest
    assert step < DDP["training.max_steps"]
    assert checkpoint == project / f"data/checkpoints/step-{step:07d}" and checkpoint.is_dir()
    assert (f"[train] stopped at step {step} on SIGUSR1: checkpoint {checkpoint} saved; a "
            "restart resumes from it") in seen
    assert not (project / "data/trained").exists()
    assert not (project / "data/metrics/train.json").exists()
    # the requeued job: resume auto; the stopped file of the attempt before goes at start
    write_params(project, {"checkpoint.resume_from_checkpoint": "auto"})
    out = ended(torchrun(project, job_file(project, stopped)))
    assert f"resumed from {checkpoint} at step {step}" in out
    assert not stopped.exists()
    full, agent = ddp_full
    ended(agent)
    same_weights(full, project)
    assert losses(project) == losses(full)
