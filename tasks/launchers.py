"""`distributed.launcher` -> the job that starts the train stage's workers.

Each job class starts the workers its way and has the same shape (enter, `go`, `abort`,
`wait`, exit: tasks/launch.py's TorchrunJob), so the train stage is one code path whatever
starts the workers: torchrun here (`local`), or a SLURM batch job (`slurm`, tasks/slurm/).
A new launcher is one module plus a line in LAUNCHERS.
"""

from __future__ import annotations

import shlex

from finetune.registry import Registry
from finetune.workspace import Workspace

LAUNCHERS: Registry = Registry("launcher", "distributed.launcher", built_ins={
    "local": "tasks.launch:TorchrunJob", "slurm": "tasks.slurm.job:SlurmJob"})


def launch(ws: Workspace, handshake: bool = True):
    """The job of distributed.launcher, not yet started (`with launch(ws) as job:`)."""
    return LAUNCHERS.get(ws.config.distributed.launcher)(ws, handshake=handshake)


def dry_run(ws: Workspace) -> str:
    """What the train stage would start, without starting it: the torchrun command (local)
    or the sbatch script it would submit (slurm)."""
    if ws.config.distributed.launcher == "slurm":
        from tasks.slurm.job import dry_run as slurm_dry_run

        return slurm_dry_run(ws)
    from tasks.launch import torchrun_command

    return shlex.join(torchrun_command(ws, ws.root / "JOB.json"))
