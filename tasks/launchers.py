"""`distributed.launcher` -> the job that starts the train stage's workers.

Each job class starts the workers its way and has the same shape (enter, `go`, `abort`,
`wait`, exit, and `dry_run(ws)`: tasks/launch.py's TorchrunJob), so the train stage is one code
path whatever starts the workers: torchrun here (`local`), or a SLURM batch job (`slurm`,
tasks/slurm/).
A new launcher is one module plus a line in LAUNCHERS.
"""

from __future__ import annotations

from finetune.registry import Registry
from finetune.workspace import Workspace

LAUNCHERS: Registry = Registry("launcher", "distributed.launcher", built_ins={
    "local": "tasks.launch:TorchrunJob", "slurm": "tasks.slurm.job:SlurmJob"})


def launch(ws: Workspace, handshake: bool = True):
    """The job of distributed.launcher, not yet started (`with launch(ws) as job:`)."""
    return LAUNCHERS.get(ws.config.distributed.launcher)(ws, handshake=handshake)


def dry_run(ws: Workspace) -> str:
    """What the train stage would start, without starting it (each launcher's `dry_run`: the
    torchrun command, or the sbatch script it would submit), ending with a newline."""
    return LAUNCHERS.get(ws.config.distributed.launcher).dry_run(ws)
