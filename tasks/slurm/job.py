"""The train stage's SLURM job: submitted, confirmed, and followed until it ends.

The same handshake as a local torchrun job (tasks/launch.py): the job is submitted first (it
may wait in the queue while the stage runs its checks and opens the MLflow run), and the main
rank writes nothing until the stage's go file says so; a failed check writes "abort" there and
cancels the job. Then the stage follows the job: every node's output streams in with a
`[node N]` prefix, the main rank's logged rows reach MLflow through the rows file, SLURM's
state changes (queued, running, requeued) are printed as they happen, and the stage ends with
the job: done when it completed, one line when it did not. Ctrl-C cancels the job.

Everything the job reads and writes is in a run folder under data/logs/slurm/ in the project,
which every node must see (shared storage), as they must see the data and the checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from engine.process.failures import Report
from finetune.errors import PipelineError, warn
from finetune.files import write_json_atomic
from finetune.workspace import Workspace
from tasks.launch import RowTail, job_spec
from tasks.launch_failure import RunFailure, explain
from tasks.slurm import commands, script
from tasks.slurm.commands import JobState

#: where a stage's SLURM runs keep their folders (under the project's data/logs)
RUNS = "slurm"
#: the job a train stage submitted and has not seen end: {"job_id", "run_dir"}
ACTIVE = "active.json"
#: how long the stage keeps asking a controller that does not answer before it lets go
CONTACT_GRACE_S = 300


def run_dir(ws: Workspace) -> Path:
    """A new run folder: data/logs/slurm/train-<UTC time>."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
    return ws.layout.logs / RUNS / f"train-{stamp}"


class SlurmJob:
    """`with SlurmJob(ws) as job:` submits the job; then `job.go(relay)` + `job.wait()`, or
    `job.abort(why)` (tasks/launch.py's TorchrunJob has the same shape)."""

    @staticmethod
    def dry_run(ws: Workspace) -> str:
        """The script the stage would submit (its run folder named as it would be)."""
        return script.render(ws, run_dir(ws))

    def __init__(self, ws: Workspace, handshake: bool = True):
        self.ws = ws  # `handshake`: always on (the job's main rank waits for the go file)
        self.job_id: str | None = None
        self._relay: RowTail | None = None
        self._logs: dict[Path, int] = {}  # file -> bytes already shown
        self._last: JobState | None = None
        self._let_go = False  # lost contact: leave the job alone

    # -- submit ------------------------------------------------------------------------------
    def __enter__(self) -> "SlurmJob":
        commands.require("sbatch")
        self.active = self.ws.layout.logs / RUNS / ACTIVE
        self._refuse_if_a_job_still_runs()
        self.dir = run_dir(self.ws)
        self.error_dir = self.dir / "errors"
        self.error_dir.mkdir(parents=True)
        self.go_file, self.rows_file = self.dir / "go.json", self.dir / "rows.jsonl"
        handshake = dict(error_dir=str(self.error_dir), go_file=str(self.go_file),
                         ready_file=None)
        spec = job_spec(self.ws, **handshake)
        preemption = dict(stop_signal=f"SIG{self.ws.config.distributed.slurm.signal}",
                          stopped_file=str(self.dir / script.STOPPED_FILE),
                          node_rank_env="SLURM_NODEID")
        spec = dataclasses.replace(spec, **preemption)
        spec.write(self.dir / script.JOB_FILE)
        # a requeued job: this run's newest checkpoint, if its fingerprint matches
        resumed = spec.config | {"checkpoint": {**spec.config["checkpoint"],
                                                "resume_from_checkpoint": "auto"}}
        dataclasses.replace(spec, config=resumed).write(self.dir / script.RESUME_JOB_FILE)
        path = self.dir / script.SCRIPT_FILE
        path.write_text(script.render(self.ws, self.dir))
        self.job_id = commands.submit(path, self.ws.root)
        write_json_atomic(self.active, {"job_id": self.job_id, "run_dir": self._where()})
        print(f"[train] submitted SLURM job {self.job_id} "
              f"({path.relative_to(self.ws.root)})", flush=True)
        return self

    def _refuse_if_a_job_still_runs(self) -> None:
        """A stage that died (a killed login shell) leaves its job running, writing this
        project's checkpoints and outputs: a second job beside it would write them too."""
        if not self.active.exists():
            return
        earlier = json.loads(self.active.read_text())
        now = commands.state(earlier["job_id"])
        if now is not None and not now.ended:
            raise PipelineError(
                f"SLURM job {earlier['job_id']} of an earlier train stage is still {now.state} "
                f"and writes this project's outputs ({earlier['run_dir']}): wait for it to end "
                f"or cancel it (scancel {earlier['job_id']}), then run the stage again")
        self.active.unlink()

    def go(self, relay: Callable[[dict], None] | None = None) -> None:
        """Confirm the job; `relay` gets every row the main rank logs (in a thread)."""
        if relay is not None:
            self.rows_file.touch()
            self._relay = RowTail(self.rows_file, relay)
        write_json_atomic(self.go_file, {"relay_file": str(self.rows_file) if relay else None})

    def abort(self, why: str) -> None:
        """A check failed before the job wrote anything: tell it, and cancel it."""
        write_json_atomic(self.go_file, {"abort": why})
        commands.cancel(self.job_id)

    # -- follow ------------------------------------------------------------------------------
    def wait(self) -> None:
        """Follow the job to its end; return when it completed, else raise its one line."""
        poll = self.ws.config.distributed.slurm.poll_seconds
        while True:
            now = self._ask()
            self._show_logs()
            if now is None:  # gone from SLURM's memory (MinJobAge) between two polls
                raise RunFailure(f"SLURM job {self.job_id} is no longer known to scontrol "
                                 f"(last seen {self._last.state if self._last else 'never'}); "
                                 f"its logs: {self._where()}")
            self._show_state(now)
            if now.ended:
                break
            time.sleep(poll)
        self._show_logs()
        self.active.unlink(missing_ok=True)
        relay_error = self._relay.finish() if self._relay else None
        self._relay = None
        if now.state != "COMPLETED" or now.exit_status != 0:
            self._explain(now)
        if self._stderr().strip():  # warnings, progress bars: kept, not shown
            print(f"[slurm] the nodes' stderr: {self._where()}/node-*.err", flush=True)
        if relay_error is not None:
            raise PipelineError(f"training finished but logging its rows failed: "
                                f"{type(relay_error).__name__}: {relay_error}")

    def _ask(self) -> JobState | None:
        """The job's state; a controller that does not answer (restarting, overloaded) is
        asked again for CONTACT_GRACE_S, then the stage lets go of the job, which runs on."""
        since = None
        while True:
            try:
                return commands.state(self.job_id)
            except PipelineError as exc:
                if since is None:
                    since = time.monotonic()
                    warn(f"SLURM does not answer ({exc}); asking again for up to "
                         f"{CONTACT_GRACE_S} s")
                elif time.monotonic() - since > CONTACT_GRACE_S:
                    self._let_go = True  # the job is fine as far as anyone knows
                    raise RunFailure(
                        f"lost contact with SLURM for {CONTACT_GRACE_S} s; job {self.job_id} "
                        f"was left as it is (squeue -j {self.job_id}); its folder "
                        f"{self._where()}") from None
                time.sleep(min(10.0, self.ws.config.distributed.slurm.poll_seconds * 5))

    def _show_state(self, now: JobState) -> None:
        """One line per change: queued (and why), running where, requeued."""
        last = self._last
        self._last = now
        if last is not None and (now.state, now.reason, now.restarts) == (
                last.state, last.reason, last.restarts):
            return
        where = f" on {now.nodes}" if now.state == "RUNNING" else ""
        why = f" ({now.reason})" if now.reason not in ("None", "") else ""
        if last is not None and now.restarts > last.restarts:
            print(f"[slurm] job {self.job_id} requeued (restart {now.restarts}): "
                  f"{now.state}{why}", flush=True)
            return
        again = f", restart {now.restarts}" if now.restarts else ""
        print(f"[slurm] job {self.job_id} {now.state}{where}{why}{again}", flush=True)

    def _show_logs(self) -> None:
        """New complete lines of the batch log and of every node's output."""
        for path in sorted(self.dir.glob("node-*.out")) + [self.dir / script.BATCH_LOG]:
            node = path.stem.removeprefix("node-")
            for line in self._new_lines(path):
                if path.name == script.BATCH_LOG:
                    print(line if line.startswith("[") else f"[slurm] {line}", flush=True)
                else:
                    print(f"[node {node}] {line}", flush=True)

    def _new_lines(self, path: Path) -> list[str]:
        try:
            with open(path, "rb") as fh:
                fh.seek(self._logs.get(path, 0))
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for its end
        self._logs[path] = self._logs.get(path, 0) + end
        return data[:end].decode(errors="replace").splitlines()

    def _stderr(self) -> str:
        parts = []
        for path in sorted(self.dir.glob("node-*.err")):
            node = path.stem.removeprefix("node-")
            text = path.read_text(errors="replace")
            parts += [f"[node {node}] {line}" for line in text.splitlines()]
        return "\n".join(parts) + ("\n" if parts else "")

    def _where(self) -> str:
        return str(self.dir.relative_to(self.ws.root))

    def _explain(self, now: JobState) -> None:
        """The one line for a job that did not complete: the workers' own error when one
        wrote it, else SLURM's state; the nodes' stderr goes to data/logs/train-failure.log."""
        log = self._stderr()
        log_file = self.ws.layout.logs / "train-failure.log"
        try:
            log_file.write_text(log)
        except OSError:
            pass
        rel = log_file.relative_to(self.ws.root)
        if now.state not in ("CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL",
                             "DEADLINE"):
            error = explain(Report.read_all(self.error_dir), log, self.ws.config.distributed,
                            rel)
            if error is not None:
                raise error
        stopped = self.dir / script.STOPPED_FILE
        after = f" after {now.restarts} restart(s)" if now.restarts else ""
        detail = (f"stopped before its time limit and was not requeued ({stopped.name})"
                  if stopped.exists() else f"exit code {now.exit_code}")
        raise RunFailure(f"SLURM job {self.job_id} ended {now.state}{after} ({detail}; "
                         f"reason {now.reason}); nodes' log {rel}, job folder {self._where()}")

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.job_id is not None and not self._let_go:
            ended = self._last is not None and self._last.ended
            if not ended:  # an error or Ctrl-C in the stage: the job must not train on alone
                commands.cancel(self.job_id)
                print(f"[slurm] cancelled job {self.job_id}", file=sys.stderr, flush=True)
            self.active.unlink(missing_ok=True)
        if self._relay is not None:
            self._relay.finish()
