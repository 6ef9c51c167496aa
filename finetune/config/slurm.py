"""`distributed.slurm`: the train stage as a SLURM batch job (`distributed.launcher: slurm`).

The keys are sbatch's options under their own names, so a user copies them from the scripts
they already run. The job runs one launcher task (torchrun) per node, which starts that node's
training processes; the allocation still asks for one SLURM task per training process
(`gpus_per_node` or `ntasks_per_node`) with `cpus_per_task` CPUs each, which is what the
cluster's accounting and limits expect. None of these keys changes what is trained, so none is
in a checkpoint's fingerprint: a run may be resumed on the cluster that another started.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator, model_validator

from finetune.config import compat
from finetune.config.section import Field, Section

#: SLURM's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
#: days-hours:minutes, days-hours:minutes:seconds, or UNLIMITED
_TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")


class SlurmConfig(Section):
    """sbatch options for the train stage's job, and how it is launched and followed."""

    job_name: str = Field("finetune-train", fingerprint=False,
                          description="The job's name in squeue (sbatch --job-name).")
    nodes: int | None = Field(
        None, gt=0, fingerprint=False,
        description="Nodes to allocate (sbatch --nodes); default distributed.nnodes, which it "
        "must equal.")
    gpus_per_node: int | None = Field(
        None, gt=0, fingerprint=False,
        description="GPUs per node (sbatch --gpus-per-node), one training process each; "
        "default none (a CPU job). Must equal distributed.nproc_per_node.")
    ntasks_per_node: int | None = Field(
        None, gt=0, fingerprint=False,
        description="Training processes per node (sbatch --ntasks-per-node); default "
        "gpus_per_node, else distributed.nproc_per_node, which it must equal.")
    cpus_per_task: int | None = Field(
        None, gt=0, fingerprint=False,
        description="CPUs per training process (sbatch --cpus-per-task); default the "
        "cluster's (one).")
    partition: str | None = Field(None, fingerprint=False, description="sbatch --partition.")
    account: str | None = Field(None, fingerprint=False, description="sbatch --account.")
    qos: str | None = Field(None, fingerprint=False, description="sbatch --qos.")
    time: str | None = Field(
        None, fingerprint=False,
        description="Time limit (sbatch --time: minutes, HH:MM:SS, D-HH:MM, ...); default "
        "the partition's.")
    mem: str | None = Field(None, fingerprint=False,
                            description="Memory per node (sbatch --mem, e.g. 64G).")
    constraint: str | None = Field(None, fingerprint=False,
                                   description="Node features (sbatch --constraint).")
    exclusive: bool = Field(False, fingerprint=False,
                            description="Whole nodes, shared with no other job (--exclusive).")
    extra_sbatch: list[str] = Field(
        default_factory=list, fingerprint=False,
        description="More '#SBATCH ...' lines, written into the script as they are.")
    setup: list[str] = Field(
        default_factory=list, fingerprint=False,
        description="Shell lines the job runs on the first node before the launch "
        "(module load, activating an environment).")
    python: str | None = Field(
        None, fingerprint=False,
        description="The Python the job runs torchrun with; default the one running the "
        "stage (the compute nodes must see it at that path), or e.g. 'python' after setup "
        "activated an environment.")
    signal: Literal["USR1", "USR2"] = Field(
        "USR1", fingerprint=False,
        description="The signal SLURM sends before the time limit (sbatch --signal): the run "
        "saves a checkpoint at the next step, stops, and the job requeues itself.")
    signal_seconds: int | None = Field(
        300, ge=10, fingerprint=False,
        description="How long before the time limit the signal comes (SLURM may send it up "
        "to a minute earlier); null: none (a job at its limit is killed, and only a "
        "periodic checkpoint is left to resume from).")
    requeue: bool = Field(
        True, fingerprint=False,
        description="sbatch --requeue: a job stopped by the signal, by preemption or by "
        "scontrol requeue starts again and resumes from its newest checkpoint.")
    rdzv_port: int | None = Field(
        None, gt=1023, lt=65536, fingerprint=False,
        description="The rendezvous port on the job's first node; default 15000 + the job id "
        "mod 10000 (two jobs sharing a node do not collide).")
    poll_seconds: float = Field(
        2.0, gt=0, fingerprint=False,
        description="How often the stage asks SLURM for the job's state while following it.")

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str | None) -> str | None:
        if value is not None and not _TIME.match(value):
            raise ValueError(f"'{value}' is not a SLURM time (minutes, MM:SS, HH:MM:SS, "
                             "D-HH, D-HH:MM or D-HH:MM:SS)")
        return value

    @field_validator("extra_sbatch")
    @classmethod
    def _sbatch_lines(cls, lines: list[str]) -> list[str]:
        for i, line in enumerate(lines):
            if not line.startswith("#SBATCH ") or "\n" in line:
                raise ValueError(f"item {i} {line!r} is not one '#SBATCH --option' line")
        return lines

    @property
    def per_node(self) -> int | None:
        """Training processes per node as these keys ask (None: distributed's)."""
        return self.ntasks_per_node or self.gpus_per_node

    @model_validator(mode="after")
    def _compat(self) -> "SlurmConfig":
        compat.check(self, "distributed.slurm")
        return self


def _world_size(d) -> str | None:
    """launcher slurm: the allocation's processes are the run's world size."""
    if d.launcher != "slurm" or d.slurm is None:
        return None
    s = d.slurm
    nodes, per_node = s.nodes or d.nnodes, s.per_node or d.nproc_per_node
    if (nodes, per_node) == (d.nnodes, d.nproc_per_node):
        return None
    asked = " and ".join(f"slurm.{k} {getattr(s, k)}" for k in ("nodes", "ntasks_per_node",
                                                                 "gpus_per_node")
                         if getattr(s, k) is not None)
    return (f"{asked}: {nodes} x {per_node} = {nodes * per_node} processes, but "
            f"distributed.nnodes {d.nnodes} x nproc_per_node {d.nproc_per_node} make a world "
            f"size of {d.world_size}; make them agree (unset, the slurm keys take "
            "distributed's)")


compat.add_rows("distributed.slurm", [
    compat.Agree("distributed.slurm", ("ntasks_per_node", "gpus_per_node"), lambda s: (
        f"ntasks_per_node {s.ntasks_per_node} and gpus_per_node {s.gpus_per_node} differ "
        "(one training process per GPU); set one of them")
        if s.ntasks_per_node and s.gpus_per_node and s.ntasks_per_node != s.gpus_per_node
        else None, example={"distributed.launcher": "slurm", "distributed.strategy": "ddp",
                            "distributed.nproc_per_node": 2,
                            "distributed.slurm.ntasks_per_node": 2,
                            "distributed.slurm.gpus_per_node": 4}),
])
compat.add_rows("distributed", [
    compat.Refuse("distributed", "slurm", compat.When(
        "launcher: local", lambda d: d.launcher == "local"),
        "the section would be ignored: set launcher: slurm or remove it",
        used=lambda d: d.slurm is not None,
        example={"distributed.slurm.partition": "gpu"}),
    compat.Agree("distributed", ("slurm.nodes", "nnodes", "nproc_per_node"), _world_size,
                 example={"distributed.launcher": "slurm", "distributed.slurm.nodes": 2}),
    compat.Refuse("distributed", "node_rank", compat.When(
        "launcher: slurm", lambda d: d.launcher == "slurm"),
        "SLURM gives each node its rank; leave node_rank 0",
        example={"distributed.launcher": "slurm", "distributed.strategy": "ddp",
                 "distributed.nnodes": 2, "distributed.node_rank": 1}),
])
