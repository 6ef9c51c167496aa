"""Test helpers shared by the test files (the fixtures built on them are in conftest.py).

Tests never touch the working tree they run from: each pipeline test copies the tracked files
into a temp folder (`copy_project`: its own git repo, DVC, MLflow store) and shrinks the default
params to seconds (`TINY`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# The embedded default, shrunk: same model and data, a few steps.
TINY = {
    "data.max_train_samples": 48,
    "data.max_eval_samples": 16,
    "data.max_seq_length": 256,
    "data.max_dropped_fraction": 0.25,
    "training.max_steps": 6,
    "training.per_device_train_batch_size": 4,
    "training.per_device_eval_batch_size": 8,
    "logging.logging_steps": 2,
    "checkpoint.save_steps": 3,
    "eval.eval_steps": 3,
    "eval.eval_batches": 1,
    "scheduler.warmup_steps": 1,
    "eval.generation_max_new_tokens": 32,
    # one torch thread per process: a 260K-parameter model gains nothing from more, and
    # test files run side by side (pytest-xdist) without oversubscribing the cores
    "distributed.threads_per_process": 1,
    # the machine's own kernels: in-process runs (train_here) cannot take portable numerics'
    # pins (torch is loaded), and tests compare them bitwise with runs through the stage;
    # portable numerics are tested in test_numerics.py and by test_pipeline's default run
    "training.cpu_numerics": "native",
}


def _project_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    skip = ("data/raw/", "data/formatted/", "data/tokenized/", "data/trained/",
            "data/checkpoints/", "data/export/", "data/metrics/", "data/plots/", "data/eval/",
            "data/lineage/", "dvc.lock")
    return [f for f in out if f and not f.startswith(skip) and (ROOT / f).is_file()]


def copy_project(dest: Path, overrides: dict | None = None) -> Path:
    """Tracked project files -> `dest`, as a fresh git repo with the params shrunk."""
    for rel in _project_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    write_params(dest, {**TINY, **(overrides or {})})
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=dest, check=True, capture_output=True)
    return dest


def write_params(project: Path, overrides: dict, name: str = "params/default.yaml") -> Path:
    from finetune.config.loader import set_keys

    path = project / name
    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    if path.exists():
        raw = yaml.safe_load(path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(set_keys(raw, overrides), sort_keys=False))
    return path


def run_cli(project: Path, *args: str, check: bool = False,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "finetune"), *args], cwd=project, capture_output=True,
                          text=True, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"finetune {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def stages_here(project: Path, *names: str, params: str = "params/default.yaml") -> None:
    """Run stages as `finetune stage NAME` does, minus the CLI process: the same stage
    functions (tasks.stage_function) from the project folder, seconds faster per stage.
    For tests where no process boundary is under test (train still launches torchrun)."""
    from finetune.workspace import Workspace
    from tasks import stage_function

    here = os.getcwd()
    os.chdir(project)
    sys.path.append(str(project))  # after this code's own copy (see as_a_worker)
    try:
        for name in names:
            stage_function(name)(Workspace.load(project / params))
    finally:
        sys.path.remove(str(project))
        os.chdir(here)


def refused_here(project: Path, *names: str) -> str:
    """`stages_here(project, *names)` expecting the stage's PipelineError: asserts it is one
    line and returns it (the CLI prints it as `error: ` + this line and exits 2: that mapping
    is tests/test_cli.py's, so a refusal needs no CLI process of its own)."""
    import pytest

    from finetune.errors import PipelineError

    with pytest.raises(PipelineError) as refused:
        stages_here(project, *names)
    line = str(refused.value)
    assert line and "\n" not in line, line
    return line


#: the shipped examples on the shipped stories260K instead of the default run's export
ON_STORIES = ("model.name_or_path=data/models/stories260K",)


def resolve_example(project: Path, example: str, overrides: dict, *settings: str,
                    name: str = "params/default.yaml") -> None:
    """The shipped params file `example` in its resolved form (`finetune config -p example -s
    setting...`, as a user makes it their own) written to `name`, with `overrides` set."""
    args = [a for setting in settings for a in ("-s", setting)]
    resolved = run_cli(project, "config", "-p", example, *args, check=True).stdout
    (project / name).write_text(resolved)
    write_params(project, overrides, name)


def prepared_example(dest: Path, example: str, overrides: dict, *settings: str) -> Path:
    """A project whose params are the shipped `example` resolved (`resolve_example`), shrunk
    by TINY and `overrides`, with download, format and tokenize done."""
    project = copy_project(dest)
    resolve_example(project, example, {**TINY, **overrides}, *settings)
    stages_here(project, "download", "format", "tokenize")
    return project


def error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The CLI's contract for bad input: exit 2 (`code`: other failures) and exactly one
    `error:` line, no traceback."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


# -- training helpers shared by test_training and test_strategies ---------------------------

def train_stage_copy(src: Path, dest: Path) -> Path:
    """Train a copy of `src` through the train stage (torchrun, its MLflow run) called in this
    process (stages_here): what a fixture needs that only wants the stage's outputs, without
    the CLI process's start-up."""
    shutil.copytree(src, dest, symlinks=True)
    stages_here(dest, "train")
    return dest


def train_copy(src: Path, dest: Path, overrides: dict | None = None):
    shutil.copytree(src, dest, symlinks=True)
    if overrides:
        write_params(dest, overrides)
    proc = run_cli(dest, "stage", "train", check=True)
    return dest, proc


@contextlib.contextmanager
def output_of_this_process_and_children():
    """What this process and the processes it starts write to fd 1 and 2 (the torchrun
    workers inherit them), read back as text into the yielded CompletedProcess's stdout and
    stderr once the block ends."""
    import io
    import tempfile

    result = subprocess.CompletedProcess(args=[], returncode=0, stdout="", stderr="")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        so = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        se = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        try:
            with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                yield result
        finally:
            so.flush()
            se.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            for name, f in (("stdout", out), ("stderr", err)):
                f.seek(0)
                setattr(result, name, f.read().decode(errors="replace"))


def train_copy_here(src: Path, dest: Path, overrides: dict | None = None):
    """`train_copy` with the train stage called in this process (stages_here: the same stage
    function, which launches the same torchrun job and MLflow run) instead of a `finetune
    stage train` CLI process: for tests of what the workers compute (several processes
    equal one, a strategy's log lines), where the CLI's process start-up (~6 s of CPU) is no
    part of what is tested (the CLI's own contract is test_cli's and test_pipeline's). The
    stage's output, its workers' included, is returned as a CompletedProcess's stdout and
    stderr, as train_copy's."""
    shutil.copytree(src, dest, symlinks=True)
    if overrides:
        write_params(dest, overrides)
    return dest, train_stage_here(dest)


def train_stage_here(project: Path) -> subprocess.CompletedProcess:
    """The train stage on `project` called in this process (see train_copy_here), as
    `run_cli(project, "stage", "train", check=True)` returns it: its output (the torchrun
    workers' included) as stdout and stderr; a failure raises with that output."""
    from finetune.errors import PipelineError

    with output_of_this_process_and_children() as proc:
        try:
            stages_here(project, "train")
        except PipelineError as exc:
            failed = exc
        else:
            failed = None
    if failed is not None:
        raise AssertionError(f"train stage in {project} failed: {failed}\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return proc


def losses(project: Path) -> list[float]:
    import csv

    with open(project / "data/plots/train.csv") as fh:
        return [float(r["loss"]) for r in csv.DictReader(fh)]


def adapter(project: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(project / "data/trained/adapter_model.safetensors"))


def train_metrics(project: Path) -> dict:
    """The train stage's final metrics, its timings (data/logs, not git-tracked) merged in."""
    import json

    timings = project / "data/logs/train_timings.json"
    return {**json.loads((project / "data/metrics/train.json").read_text()),
            **(json.loads(timings.read_text()) if timings.exists() else {})}


def assert_weights_close(a, b):
    """Summation order differs between the two layouts; Adam divides by sqrt(v), which turns
    1e-7 gradient noise on near-zero gradients into ~3e-5 weight noise after 4 steps at lr 5e-3.
    A real weighting bug moves weights by ~lr (5e-3), far above this bound."""
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 2e-4, worst


def stage_outputs(project: Path) -> dict[str, str]:
    """Every file the train stage writes, by content (to show a failure changed nothing)."""
    import hashlib

    found = {}
    for folder in ("checkpoints", "trained", "metrics", "plots", "lineage"):
        for path in sorted((project / "data" / folder).rglob("*")):
            if path.is_file():
                found[str(path.relative_to(project))] = hashlib.sha256(
                    path.read_bytes()).hexdigest()
    return found


def wait_until_no_process_in(project: Path, timeout: float = 10) -> None:
    """Fails unless every process running in `project` (by cwd) is gone within `timeout`."""
    import time

    import psutil

    def inside() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if Path(proc.cwd()) == project:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return found

    deadline = time.monotonic() + timeout
    while inside() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not inside(), "processes of the killed stage still run"


def kill_after_first_checkpoint(project) -> str:
    """Start the train stage, SIGKILL its whole process tree once a checkpoint is written."""
    return kill_train_stage_when(project, lambda line: line.startswith("[train] checkpoint"))


def kill_train_stage_when(project, said) -> str:
    """Start the train stage, SIGKILL its whole process group at the first line `said(line)`
    is true of; returns what it printed."""
    proc = subprocess.Popen([str(BIN / "finetune"), "stage", "train"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if said(line):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


def interrupt_then_resume(tokenized: Path, tmp_path: Path, params: dict,
                          full: Path | None = None):
    """Train `params` uninterrupted (`full`: a run of `params` done already; else in-process,
    or through the stage when it needs several processes); train it again through the stage,
    SIGKILL the run right after its first checkpoint and resume it. Asserts the two end
    bitwise equal; returns (full, cut, resume stdout)."""
    import torch

    if full is None:
        several = params.get("distributed.nproc_per_node", 1) > 1
        full, _ = (train_copy_here if several else train_here)(tokenized, tmp_path / "full",
                                                                params)
    cut = tmp_path / "cut"
    shutil.copytree(tokenized, cut, symlinks=True)
    write_params(cut, params)
    kill_after_first_checkpoint(cut)
    assert not (cut / "data/trained").exists()
    write_params(cut, {"checkpoint.resume_from_checkpoint": True})
    proc = train_stage_here(cut)  # the kill was the stage process's; the resume needs none
    assert "resumed from" in proc.stdout
    a, b = adapter(full), adapter(cut)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from uninterrupted"
    assert losses(cut) == losses(full)
    return full, cut, proc.stdout


# -- the engine in-process: options that need no process boundary ---------------------------

class InProcess:
    """What a train run printed, in the shape tests read from a CLI run (`.stdout`)."""

    def __init__(self, stdout: str):
        self.stdout = stdout


def train_here(src: Path, dest: Path, overrides: dict | None = None):
    """Train a copy of `src` in this process with the job the train stage hands torchrun
    (tasks.launch.job_spec -> engine.worker.run_job): the same code as `finetune stage train`
    minus the process boundary and MLflow, seconds faster per run. Process-wide torch
    settings a run may change (determinism, anomaly mode, matmul precision) are restored."""
    shutil.copytree(src, dest, symlinks=True)
    if overrides:
        write_params(dest, overrides)
    return dest, train_in_place(dest)


def train_in_place(dest: Path) -> InProcess:
    """`train_here` on a project as it is (e.g. to resume it)."""
    from engine.worker import run_job
    from finetune.workspace import Workspace
    from tasks.launch import job_spec

    with as_a_worker(dest) as out:
        run_job(job_spec(Workspace.load(dest / "params/default.yaml")))
    return InProcess(out.getvalue())


@contextlib.contextmanager
def as_a_worker(project: Path):
    """Run a job in this process as a worker would: in the project folder, its 'module:Class'
    references importable, stdout captured (yields the buffer); process-wide torch settings a
    run may change (determinism, anomaly mode, matmul precision, threads, default dtype,
    dynamo limits) and the project's own modules are restored or dropped afterwards."""
    import io

    import torch
    import torch._dynamo.config as dynamo
    import torch._functorch.config as functorch

    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(),
             torch.get_float32_matmul_precision(), torch.get_num_threads(),
             torch.get_default_dtype(), dynamo.recompile_limit,
             functorch.activation_memory_budget)
    before = set(sys.modules)
    here = os.getcwd()
    os.chdir(project)
    # appended: a test project is a copy of this code too, and a second copy of an engine
    # module imported from it would not be the same module (its classes not the same classes)
    sys.path.append(str(project))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield out
    finally:
        os.chdir(here)
        sys.path.remove(str(project))
        for name in set(sys.modules) - before:  # the project's own modules, if any
            if getattr(sys.modules[name], "__file__", "") and str(project) in (
                    sys.modules[name].__file__ or ""):
                del sys.modules[name]
        torch.use_deterministic_algorithms(saved[0])
        torch.autograd.set_detect_anomaly(saved[1])
        torch.set_float32_matmul_precision(saved[2])
        torch.set_num_threads(saved[3])
        torch.set_default_dtype(saved[4])
        dynamo.recompile_limit, functorch.activation_memory_budget = saved[5], saved[6]


def resume_from_checkpoint_in_process(src: Path, tmp_path: Path, params: dict, at: int) -> str:
    """Train `params` in-process; cut a copy back to what a crash right after the step-`at`
    checkpoint leaves (later checkpoints, the trained model and the curves gone) and resume
    it in-process. Asserts bitwise equal weights and equal losses; returns the resume's log."""
    full, _ = train_here(src, tmp_path / "full", params)
    return resume_cut_back(full, tmp_path, at, train_in_place)


def cut_back(full: Path, cut: Path, at: int, overrides: dict | None = None) -> Path:
    """A copy of the finished run `full` as a crash right after its step-`at` checkpoint
    leaves it (later checkpoints, the trained model and the curves gone), set to resume
    (with `overrides`: e.g. another number of processes)."""
    shutil.copytree(full, cut, symlinks=True)
    for checkpoint in (cut / "data/checkpoints").glob("step-*"):
        if int(checkpoint.name.removeprefix("step-")) > at:
            shutil.rmtree(checkpoint)
    shutil.rmtree(cut / "data/trained")
    for curve in ("train.csv", "eval.csv"):
        (cut / "data/plots" / curve).unlink(missing_ok=True)
    write_params(cut, {**(overrides or {}), "checkpoint.resume_from_checkpoint": True})
    return cut


def resume_cut_back(full: Path, tmp_path: Path, at: int, resume=None) -> str:
    """A copy of the finished run `full` cut back to its step-`at` checkpoint, resumed with
    `resume(project)` (default: through the stage); asserts it ends exactly as `full`."""
    import torch

    resume = resume or (lambda project: run_cli(project, "stage", "train", check=True))
    cut = cut_back(full, tmp_path / "cut", at)
    out = resume(cut).stdout
    assert f"step-{at:07d} at step {at}" in out, out
    a, b = adapter(full), adapter(cut)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from uninterrupted"
    assert losses(cut) == losses(full)
    return out


@contextlib.contextmanager
def rows_seen():
    """Which split rows each optimizer step of an in-process run consumed (step index ->
    set of row ids), read where the loop counts a micro-batch as consumed (prefetched ones
    it never trains on are not counted): a test-only observer, the batch is not changed."""
    from engine.reporting.progress import Progress

    seen: dict[int, set[int]] = {}
    original = Progress.consume

    def consume(self, batch):
        seen.setdefault(self.step, set()).update(batch["rows"].tolist())
        return original(self, batch)

    Progress.consume = consume
    try:
        yield seen
    finally:
        Progress.consume = original


# -- small readers shared by test_training and test_run_control --------------------------

#: a 4-step in-process run without checkpoints, logging every step
BASE = {"training.max_steps": 4, "checkpoint.save_strategy": "no", "eval.eval_steps": 4,
        "logging.logging_steps": 1}


def checkpoint_names(project) -> list[str]:
    return sorted(p.name for p in (project / "data/checkpoints").iterdir())


def logged_column(project, name: str, file: str = "train.csv") -> list[float]:
    import csv

    with open(project / "data/plots" / file) as fh:
        return [float(r[name]) for r in csv.DictReader(fh)]


#: the MLflow metrics a training run has: what the loop logs at its steps (History's rows);
#: the evaluate stage adds `eval.*` (tests/test_pipeline.py)
PER_STEP_SERIES = {"loss", "learning_rate", "grad_norm", "tokens_per_second",
                   "num_input_tokens_seen", "memory_rss_mb", "epoch", "comm_bytes_per_step",
                   "eval_loss", "eval_seconds"}  # eval_seconds: at each evaluation's step


def product_changes(project: Path) -> list[str]:
    """`git status --porcelain` lines of a project copy outside what the pipeline writes (its
    data, MLflow store and DVC files): what a test's own files changed in the product."""
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                             cwd=project, capture_output=True, text=True, check=True).stdout
    return sorted(line for line in changed.splitlines()
                  if not line[3:].startswith(("data/", "mlflow", "dvc", ".dvc", "dvc.lock")))


def plugin_run(folder: Path, file: str, source: str, params: dict) -> Path:
    """A project copy with one plug-in file of its own (a method, a model kind) and the params
    naming it, run through all six stages in-process (stages_here)."""
    project = copy_project(folder / "p")
    (project / file).write_text(source)
    write_params(project, {"logging.logging_steps": 1, "eval.max_generation_samples": 2,
                           **params})
    stages_here(project, "download", "format", "tokenize", "train", "evaluate", "export")
    return project


def sft_first_step_loss(trained: Path, folder: Path) -> float:
    """Plain SFT's first logged loss on the rows `trained` tokenized (its data stages copied):
    what a plug-in's own objective is compared with. Trained in this process (train_in_place,
    the job the stage hands torchrun): a reference number, no process boundary under test
    (through the stage it was a torchrun start, ~10 s, for one step)."""
    sft = copy_project(folder / "sft")
    write_params(sft, {"training.max_steps": 1, "logging.logging_steps": 1})
    for stage in ("data/raw", "data/formatted", "data/tokenized"):
        subprocess.run(["cp", "-r", str(trained / stage), str(sft / stage)], check=True)
    train_in_place(sft)
    return logged_column(sft, "loss")[0]
