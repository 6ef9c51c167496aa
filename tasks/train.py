"""Stage 4, train: launch `torchrun` on the engine worker with the validated config.

Single-process runs go through torchrun too (nproc_per_node 1), so the code a user tests on a
laptop is the code that runs on 8 GPUs. The stage opens the MLflow run, hands its id to the
worker (rank 0 logs per-step metrics into it), and records it next to the trained model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune.errors import PipelineError
from finetune.workspace import Workspace, write_json_atomic
from tasks import tracking
from tasks.curves import render_curves


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
        ]
    return cmd + ["-m", "engine.worker", str(job_file)]


def preflight(ws: Workspace) -> None:
    """Checks that need the machine, done before any process starts."""
    import torch

    from engine.loop import autocast_dtype
    from engine.model import check_quantization, model_class

    cfg = ws.config
    cuda = torch.cuda.is_available()
    model_class(cfg.model.auto_class_name)  # an unknown class fails here, not in every rank
    check_quantization(cfg.model)
    autocast_dtype(cfg, torch.device("cuda" if cuda else "cpu"))  # refuses fp16 on CPU
    if cfg.distributed.backend == "nccl" and not cuda:
        raise PipelineError("distributed.backend: nccl needs CUDA GPUs; use gloo or auto on CPU")
    if cfg.data.streaming:
        from tasks.stream import holdout_rows, open_source

        holdout_rows(cfg.data, open_source(cfg.data, ws.root))  # the train split exists
    elif not (ws.layout.tokenized / "train").exists():
        raise PipelineError(f"{ws.layout.tokenized / 'train'} missing; run the tokenize stage")
    if cfg.training.mixed_precision == "fp16" and cfg.distributed.strategy == "fsdp2":
        raise PipelineError(
            "training.mixed_precision: fp16 with strategy fsdp2 needs a sharded GradScaler, "
            "which this trainer does not use; use bf16 (distributed.fsdp.param_dtype: bfloat16)"
        )
    if cfg.checkpoint.resume_from_checkpoint:
        from engine import checkpoint as ckpt
        from engine.trainer_state import check_resumable

        path = ckpt.latest(ws.layout.checkpoints)
        if path is not None:  # no checkpoint: the worker says so and starts from scratch
            check_resumable(ckpt.read_meta(path) or {}, path, cfg.distributed.world_size,
                            cfg.distributed.strategy)


RESUME_ENV = "FINETUNE_RESUME"
STREAM_SOURCE = "tasks.stream:open_train_stream"


def train(ws: Workspace) -> dict[str, Path]:
    if os.environ.get(RESUME_ENV) == "1" and not ws.config.checkpoint.resume_from_checkpoint:
        # An orchestrator retry: continue from the latest checkpoint, not from scratch. Exact
        # resume gives the same weights, so this is not a change of params.
        cfg = ws.config.model_copy(deep=True)
        cfg.checkpoint.resume_from_checkpoint = True
        ws = Workspace(config=cfg, root=ws.root, params_path=ws.params_path)
        print(f"[train] {RESUME_ENV}=1: resuming from the latest checkpoint", flush=True)
    preflight(ws)
    if ws.config.distributed.node_rank > 0:
        return _train_worker_node(ws)
    run_id = tracking.start_run(ws)
    tokenize_stats = ws.layout.metrics / "tokenize.json"
    if tokenize_stats.exists():
        stats = json.loads(tokenize_stats.read_text())
        flat = {f"data.{split}.{k}": v for split, s in stats.items() for k, v in s.items()
                if isinstance(v, (int, float))}
        tracking.log_metrics(ws, run_id, flat)
    try:
        _launch(ws, run_id)
    except PipelineError:
        tracking.finish_run(ws, run_id, "FAILED")
        raise
    metrics = json.loads((ws.layout.metrics / "train.json").read_text())
    tracking.log_metrics(ws, run_id, {k: v for k, v in metrics.items()
                                      if isinstance(v, (int, float)) and v is not None})
    render_curves(ws.layout.plots)
    for plot in ("train.csv", "eval.csv", "curves.png"):
        tracking.client(ws).log_artifact(run_id, str(ws.layout.plots / plot), "plots")
    write_json_atomic(ws.layout.train_run, {"mlflow_run_id": run_id})
    return {"trained": ws.layout.trained, "checkpoints": ws.layout.checkpoints}


def _train_worker_node(ws: Workspace) -> dict[str, Path]:
    """node_rank > 0 of a multi-node job: run this node's ranks; node 0 (global rank 0) owns
    the MLflow run and writes the trained model, metrics and checkpoints (shared storage)."""
    _launch(ws, run_id=None)
    print(f"[train] node {ws.config.distributed.node_rank} finished; node 0 writes the outputs",
          flush=True)
    return {}


def _launch(ws: Workspace, run_id: str | None) -> None:
    """Run torchrun on the worker; a failure becomes one PipelineError line."""
    with tempfile.TemporaryDirectory(prefix="finetune-job-") as tmp:
        job_file = Path(tmp) / "job.json"
        error_file = Path(tmp) / "error.txt"
        job_file.write_text(json.dumps({
            "config": ws.config.model_dump(mode="json"),
            "root": str(ws.root),
            "mlflow_uri": ws.mlflow_uri() if run_id else None,
            "run_id": run_id,
            "error_file": str(error_file),
            # streaming: the recipe's example source, resolved by the worker on every rank
            "train_stream": STREAM_SOURCE if ws.config.data.streaming else None,
        }))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ws.root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        env.setdefault("OMP_NUM_THREADS", "1")  # the worker sets its own thread count
        stderr_file = Path(tmp) / "stderr.txt"
        with open(stderr_file, "w") as err:
            # stdout (the training log) streams live; stderr is held back so that a clean
            # one-line error is not buried under torchrun's failure dump.
            proc = subprocess.run(torchrun_command(ws, job_file), cwd=ws.root, env=env, stderr=err)
        if proc.returncode != 0:
            if error_file.exists():
                raise PipelineError(error_file.read_text())
            sys.stderr.write(stderr_file.read_text())
            raise PipelineError(f"training failed: torchrun exited {proc.returncode} (see log above)")
        sys.stderr.write(stderr_file.read_text())
