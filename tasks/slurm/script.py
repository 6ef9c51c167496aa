"""The sbatch script of the train stage: one `srun` step that starts torchrun on every node.

Inside the job the rendezvous endpoint is the allocation's first host (`scontrol show
hostnames`), the rendezvous id the job id, and each node's rank SLURM's `SLURM_NODEID` (the
workers read it: engine.process.job.JobSpec.node_rank_env). Every node's output goes to its
own file in the run folder (`node-N.out`/`.err`, appended across requeues), which the stage
streams with a `[node N]` prefix.

Preemption: SLURM sends `distributed.slurm.signal` to every process of the step
`signal_seconds` before the time limit. torchrun runs with it ignored (an ignored signal stays
ignored across exec, so the agent lives on); the workers catch it, save a checkpoint at the
next step and stop, and the main rank writes the stopped file. The script then requeues its
own job (`scontrol requeue`), and a restarted job (`SLURM_RESTART_COUNT` > 0) runs the resume
job file: the newest checkpoint of this run, bitwise as if never stopped. A job requeued from
outside (preemption by a higher-priority job, `scontrol requeue`) resumes the same way from its
newest periodic checkpoint.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from finetune import host_memory, numerics
from finetune.workspace import Workspace

JOB_FILE, RESUME_JOB_FILE = "job.json", "job-resume.json"
STOPPED_FILE, BATCH_LOG = "stopped.json", "batch.out"
#: what the job and the stage agree on about the run folder
SCRIPT_FILE = "train.sbatch"
#: the environment the stage exports that means nothing on a compute node (the stage's pid:
#: engine/process/lifetime.py)
STAGE_ONLY_ENV = ("FINETUNE_WATCH_PID", "FINETUNE_EXIT_WITH")


def sbatch_lines(ws: Workspace, run_dir: Path) -> list[str]:
    """The `#SBATCH` header: the allocation (one SLURM task per training process), the log,
    requeue and the signal before the time limit, then the user's own lines."""
    d = ws.config.distributed
    s = d.slurm
    options: list[tuple[str, object]] = [
        ("job-name", s.job_name), ("nodes", d.nnodes), ("ntasks-per-node", d.nproc_per_node),
        ("cpus-per-task", s.cpus_per_task), ("gpus-per-node", s.gpus_per_node),
        ("partition", s.partition), ("account", s.account), ("qos", s.qos), ("time", s.time),
        ("mem", s.mem), ("constraint", s.constraint),
        ("output", run_dir / BATCH_LOG), ("open-mode", "append"),
    ]
    lines = [f"#SBATCH --{name}={value}" for name, value in options if value is not None]
    if s.exclusive:
        lines.append("#SBATCH --exclusive")
    lines.append("#SBATCH --requeue" if s.requeue else "#SBATCH --no-requeue")
    if s.signal_seconds is not None:
        lines.append(f"#SBATCH --signal={s.signal}@{s.signal_seconds}")
    return lines + list(s.extra_sbatch)


def render(ws: Workspace, run_dir: Path) -> str:
    """The whole script; `run_dir`: the run folder in the project (shared storage) that holds
    the job files, the logs and the stopped file."""
    d = ws.config.distributed
    s = d.slurm
    q = shlex.quote
    run = q(str(run_dir))
    python = s.python or sys.executable
    cpus = (s.cpus_per_task or 1) * d.nproc_per_node  # the node's share, for its one launcher
    env = {"PYTHONPATH": f"{ws.root}${{PYTHONPATH:+:$PYTHONPATH}}", "OMP_NUM_THREADS": "1",
           **numerics.plan(ws.config).env, **host_memory.worker_env(ws.config)}
    port = str(s.rdzv_port) if s.rdzv_port else "$((15000 + SLURM_JOB_ID % 10000))"
    gpus = f" --gpus-per-node={s.gpus_per_node}" if s.gpus_per_node else ""
    stopped = (f'  echo "[slurm] stopped before the time limit: '
               f'$(tr -s " \\n" " " < "$RUN/{STOPPED_FILE}"); ')
    after_stop = [
        stopped + 'requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID" && sleep 600',
        '  echo "[slurm] scontrol requeue failed: resume with a new job"',
    ] if s.requeue else [stopped + 'requeue is off (distributed.slurm.requeue)"']
    return "\n".join([
        "#!/bin/bash",
        f"# The train stage of {ws.root}, written by `finetune stage train` "
        "(distributed.launcher: slurm).",
        *sbatch_lines(ws, run_dir),
        "set -uo pipefail",
        *s.setup,
        f"cd {q(str(ws.root))}",
        *(f'export {k}="{v}"' if k == "PYTHONPATH" else f"export {k}={q(v)}"
          for k, v in env.items()),
        f"unset {' '.join(STAGE_ONLY_ENV)}",
        f"RUN={run}",
        f'JOB="$RUN/{JOB_FILE}"',
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        f'  JOB="$RUN/{RESUME_JOB_FILE}"  # requeued: resume from the newest checkpoint',
        "fi",
        f'rm -f "$RUN/{STOPPED_FILE}" "$RUN"/errors/rank-*.json',
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"PORT={port}",
        'echo "[slurm] job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on '
        '$SLURM_JOB_NODELIST, rendezvous $HEAD:$PORT"',
        f"srun --nodes=$SLURM_JOB_NUM_NODES --ntasks=$SLURM_JOB_NUM_NODES --ntasks-per-node=1 "
        f"--cpus-per-task={cpus}{gpus} "
        "--kill-on-bad-exit=1 \\",
        '  --output="$RUN/node-%n.out" --error="$RUN/node-%n.err" --open-mode=append \\',
        f"  bash -c 'trap \"\" {s.signal}; exec \"$@\"' torchrun {q(python)} "
        "-m torch.distributed.run \\",
        f"  --nnodes=$SLURM_JOB_NUM_NODES --nproc_per_node={d.nproc_per_node} "
        "--rdzv_backend=c10d \\",
        f'  --rdzv_endpoint="$HEAD:$PORT" --rdzv_id="$SLURM_JOB_ID" '
        f"--rdzv_conf=join_timeout={d.rdzv_timeout},read_timeout={min(d.rdzv_timeout, 60)} \\",
        '  -m engine.worker "$JOB"',
        "code=$?",
        f'if [ -f "$RUN/{STOPPED_FILE}" ]; then',
        *after_stop,
        "  exit 1",
        "fi",
        "exit $code",
        "",
    ])
