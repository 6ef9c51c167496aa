"""The torchrun job of the train stage: job file, process, and the launch handshake.

torchrun starts first, before the stage's own checks and before the MLflow run is opened, so
the workers' start-up (torch/transformers/peft imports, model and data loading: ~6 s of the
~15 s it took to reach the first step) overlaps the launcher's work (~4 s) on another core.
Nothing is lost by starting early: rank 0 writes nothing until the launcher "confirms" the job
through the go file (checks passed, MLflow run open: its id is in the file). When a check
fails, the launcher writes "abort" there, stops torchrun and raises the check's own one-line
error, so bad input still fails before any output is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from engine.process.failures import Report
from engine.process.job import JobSpec, RunPaths
from engine.process.lifetime import WATCH_PID, child_dies_with_us
from finetune import host_memory, numerics
from finetune.errors import PipelineError
from finetune.files import write_json_atomic
from finetune.workspace import Workspace
from tasks.launch_failure import explain
from tasks.stream_manifest import MANIFEST
from tasks.teacher import teacher_columns

STREAM_SOURCE = "tasks.stream:open_train_stream"
#: the train stage's measurements of the machine (data/logs/, gitignored): they differ on
#: every run, so keeping them out of data/metrics/train.json lets a rerun leave git clean
TIMINGS_FILE = "train_timings.json"


def train_metrics(ws: Workspace) -> dict:
    """The train stage's final metrics: data/metrics/train.json with its timings merged in."""
    metrics = json.loads((ws.layout.metrics / "train.json").read_text())
    timings = ws.layout.logs / TIMINGS_FILE
    return {**metrics, **(json.loads(timings.read_text()) if timings.exists() else {})}


def run_paths(ws: Workspace) -> RunPaths:
    """The pipeline's layout, handed to the engine as explicit paths."""
    layout = ws.layout
    streamed = ws.config.data.streaming
    return RunPaths(
        project_root=ws.root,
        train_data=None if streamed else layout.tokenized / "train",
        eval_data=layout.tokenized / "test",
        checkpoints=layout.checkpoints,
        trained=layout.trained,
        metrics_file=layout.metrics / "train.json",
        # wall clock, throughput, memory: not in the git-tracked DVC metrics (TIMINGS_FILE)
        timings_file=layout.logs / TIMINGS_FILE,
        plots_dir=layout.plots,
        # a streamed split is identified by its manifest (source file hashes, sampling)
        train_identity=layout.tokenized / MANIFEST if streamed else None,
        # rows with class labels: the label map the format stage made, for the head
        labels=layout.tokenized / "labels.json" if ws.config.data.targets == "labels" else None,
        # eval.during_training_metrics: the generation rows, as the evaluate stage reads them
        formatted=layout.formatted if ws.config.eval.during_training_metrics else None,
        # offline distillation: the teacher stage's columns (tasks.teacher)
        method_columns=teacher_columns(ws),
    )


def torchrun_command(ws: Workspace, job_file: Path) -> list[str]:
    dist = ws.config.distributed
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dist.nproc_per_node}"]
    if dist.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={dist.nnodes}",
            f"--node_rank={dist.node_rank}",
            f"--rdzv_backend={dist.rdzv_backend}",
            f"--rdzv_endpoint={dist.rdzv_endpoint}",
            f"--rdzv_id={dist.rdzv_id}",
            f"--rdzv_conf=join_timeout={dist.rdzv_timeout},"
            f"read_timeout={min(dist.rdzv_timeout, 60)}",
        ]
    return cmd + ["-m", "engine.worker", str(job_file)]


def job_spec(ws: Workspace, **handshake: str | None) -> JobSpec:
    """The job every rank runs: the validated config, the run's paths, and for a streamed
    train split the recipe's example source (resolved by the worker on every rank)."""
    return JobSpec(config=ws.config.model_dump(mode="json"), paths=run_paths(ws),
                   train_stream=STREAM_SOURCE if ws.config.data.streaming else None,
                   **handshake)


def worker_environment(ws: Workspace) -> dict[str, str]:
    """torchrun's environment (its workers inherit it): this process's, the project on
    PYTHONPATH, the CPU numerics' pins and training.cpu_malloc_reuse's malloc settings."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ws.root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.setdefault("OMP_NUM_THREADS", "1")  # the worker sets its own thread count
    env.update(numerics.plan(ws.config).env)  # portable CPU numerics' pins
    env.update(host_memory.worker_env(ws.config))
    return env


class TorchrunJob:
    """`with TorchrunJob(ws, handshake=True) as job:` starts torchrun; then exactly one of
    `job.go(uri, run_id)` + `job.wait()`, or `job.abort(why)`. A failure of the workers
    becomes one PipelineError line (the worker's own message when it wrote one)."""

    @staticmethod
    def dry_run(ws: Workspace) -> str:
        """The torchrun command the stage would start (its job file named JOB.json)."""
        import shlex

        return shlex.join(torchrun_command(ws, ws.root / "JOB.json")) + "\n"

    def __init__(self, ws: Workspace, handshake: bool = True):
        self.ws, self.handshake = ws, handshake
        self.proc: subprocess.Popen | None = None
        self._relay: RowTail | None = None

    def __enter__(self) -> "TorchrunJob":
        self._tmp = tempfile.TemporaryDirectory(prefix="finetune-job-")
        tmp = Path(self._tmp.name)
        self.job_file, self.error_dir = tmp / "job.json", tmp / "errors"
        self.error_dir.mkdir()
        self.go_file, self.stderr_file = tmp / "go.json", tmp / "stderr.txt"
        job_spec(self.ws, error_dir=str(self.error_dir),
                 # rank 0 waits for this before writing anything; None: no MLflow run, no wait
                 go_file=str(self.go_file) if self.handshake else None,
                 ready_file=str(tmp / "ready") if self.handshake else None,
                 ).write(self.job_file)
        env = worker_environment(self.ws)
        env[WATCH_PID] = str(os.getpid())  # where the kernel cannot: workers watch the stage
        self._stderr = open(self.stderr_file, "w")
        # stdout (the training log) streams live; stderr is held back so that a clean one-line
        # error is not buried under torchrun's failure dump. The agent gets SIGTERM when this
        # process dies however it dies (it then stops the workers, which also die with it:
        # engine/process/lifetime.py), so no worker trains on without its stage.
        self.proc = subprocess.Popen(torchrun_command(self.ws, self.job_file), cwd=self.ws.root,
                                     env=env, stderr=self._stderr,
                                     preexec_fn=child_dies_with_us())
        return self

    def go(self, relay: Callable[[dict], None] | None = None) -> None:
        """Confirm the job. `relay`: called here, in a thread, with every row rank 0 logs
        (the stage passes its MLflow logger), so the workers never talk to trackers."""
        relay_file = None
        if relay is not None:
            relay_file = Path(self._tmp.name) / "rows.jsonl"
            relay_file.touch()
            self._relay = RowTail(relay_file, relay)
        write_json_atomic(self.go_file, {"relay_file": str(relay_file) if relay_file else None})

    def abort(self, why: str) -> None:
        """Stop the job before it wrote anything (rank 0 is still waiting for go)."""
        if self.handshake:
            write_json_atomic(self.go_file, {"abort": why})
        self._stop()

    def wait(self) -> None:
        code = self.proc.wait()
        self._stderr.flush()
        relay_error = self._relay.finish() if self._relay else None
        if code != 0:
            self._explain_failure(code)
        sys.stderr.write(self.stderr_file.read_text())
        if relay_error is not None:
            raise PipelineError(f"training finished but logging its rows failed: "
                                f"{type(relay_error).__name__}: {relay_error}")

    def _explain_failure(self, code: int) -> None:
        """Raise the one line that explains the failure; the workers' full stderr is kept in
        data/logs/train-failure.log (held back from the terminal: torchrun's dump would bury
        the line)."""
        log = self.stderr_file.read_text()
        log_file = self.ws.layout.logs / "train-failure.log"
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.write_text(log)
        except OSError:  # that disk is full too: the line is what matters
            pass
        error = explain(Report.read_all(self.error_dir), log, self.ws.config.distributed,
                        log_file.relative_to(self.ws.root))
        if error is None:
            sys.stderr.write(log)
            error = PipelineError(f"training failed: torchrun exited {code} (see log above)")
        raise error

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # torchrun forwards it to the workers
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is not None and self.proc is not None:
                self._stop()  # an exception in the launcher (Ctrl-C included) ends the job
            if self._relay is not None:
                self._relay.finish()
        finally:
            self._stderr.close()
            self._tmp.cleanup()


class RowTail:
    """Follows the rows file rank 0 appends to and hands each complete line to `relay`, in a
    thread, while training runs; `finish()` (after the workers exited) reads the rest and
    returns the first relay error, if any (rows after an error are not relayed)."""

    def __init__(self, path: Path, relay: Callable[[dict], None]):
        self.path, self.relay = path, relay
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="row-relay", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        with open(self.path) as fh:
            pending = ""
            while True:
                done = self._done.is_set()  # read once more after the workers are gone
                pending += fh.read()
                *lines, pending = pending.split("\n")
                for line in lines:
                    if line and self.error is None:
                        try:
                            self.relay(json.loads(line))
                        except BaseException as exc:  # reported by finish()
                            self.error = exc
                if done:
                    return
                self._done.wait(0.2)

    def finish(self) -> BaseException | None:
        self._done.set()
        self._thread.join()
        return self.error
