"""SLURM's own commands, as the stage uses them: submit (`sbatch --parsable`), ask for a job's
state (`scontrol show job -o`, which needs no accounting database), cancel (`scancel`).

Each failure is one line: a missing command names the key that switches back to the local
launcher, and a refused submission shows SLURM's own reason.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import PipelineError

#: states after which the job runs no more (a requeued job passes through PENDING instead)
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
SWITCH_BACK = "distributed.launcher: local"


def require(command: str) -> str:
    """The path of a SLURM command, or one line saying it is missing and how to go on."""
    path = shutil.which(command)
    if path is None:
        raise PipelineError(
            f"distributed.launcher is slurm but {command} is not on PATH: run the stage on a "
            f"SLURM login node (or load SLURM's module first), or set {SWITCH_BACK}")
    return path


def submit(script: Path, cwd: Path) -> str:
    """Submit `script`; its job id. SLURM's refusal (an unknown partition, a limit, a
    malformed option) is one line with SLURM's reason."""
    proc = subprocess.run([require("sbatch"), "--parsable", str(script)], cwd=cwd,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        reason = " ".join(line.removeprefix("sbatch: error: ").strip()
                          for line in proc.stderr.splitlines() if line.strip())
        raise PipelineError(f"SLURM refused the train job ({script}): {reason or 'no reason'} "
                            "(the job's options are the distributed.slurm keys)")
    return proc.stdout.strip().split(";")[0]  # "id" or "id;cluster"


@dataclass(frozen=True)
class JobState:
    """What `scontrol show job` says of a job (the fields the stage follows)."""

    job_id: str
    state: str
    reason: str
    restarts: int
    exit_code: str
    nodes: str

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def exit_status(self) -> int:
        """The batch script's exit status (ExitCode=status:signal)."""
        status, _, _ = self.exit_code.partition(":")
        return int(status) if status.isdigit() else -1


def state(job_id: str) -> JobState | None:
    """The job's state; None when SLURM no longer knows it (ended longer ago than the
    cluster's MinJobAge)."""
    proc = subprocess.run([require("scontrol"), "show", "job", "-o", job_id],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise PipelineError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    return parse(proc.stdout)


def parse(line: str) -> JobState:
    """One `scontrol show job -o` line -> JobState (fields are KEY=VALUE, space separated;
    only Reason and a few others may hold spaces, and none of those is read past its
    first word)."""
    fields: dict[str, str] = {}
    for token in line.split():
        key, eq, value = token.partition("=")
        if eq and key not in fields:
            fields[key] = value
    return JobState(job_id=fields.get("JobId", ""), state=fields.get("JobState", "UNKNOWN"),
                    reason=fields.get("Reason", "None"),
                    restarts=int(fields.get("Restarts", "0") or 0),
                    exit_code=fields.get("ExitCode", "0:0"),
                    nodes=fields.get("NodeList", "(null)"))


def cancel(job_id: str) -> None:
    """Cancel the job (quietly: it may have ended already)."""
    scancel = shutil.which("scancel")
    if scancel is not None:
        subprocess.run([scancel, job_id], capture_output=True)
