"""What a run puts in a checkpoint and takes back: position, scheduler, scaler, strategy
extras, monitor, metric history; resume, and load_best_model_at_end. Each takes the run
(engine.run.TrainingRun) and reads the components it needs from it.

The storage format (DCP folders, hashes, rotation) is engine.checkpoint; this module decides
the contents, so exact resume is one reviewable place, and `check_resumable` is the one rule
for "can this checkpoint continue this run" (the train stage's preflight calls it too).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine import checkpoint as ckpt
from engine.reporters import History
from finetune.config.distributed import DistributedConfig
from finetune.errors import PipelineError


def history_rows(reporters) -> list[dict]:
    return reporters.find(History).rows if reporters else []


def save(run, evaluated: dict) -> Path:
    """Collective: checkpoint the run at its current step."""
    trainer_state = {
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler else None,
        "strategy": run.strategy.trainer_state(),
        "history": history_rows(run.reporters),
        "monitor": run.monitor.state_dict(),
    }
    dist_cfg = run.cfg.distributed
    meta = {**run.progress.position(), "world_size": dist_cfg.world_size,
            "strategy": dist_cfg.resolved_strategy, **evaluated}
    path = ckpt.save(run.paths.checkpoints, run.progress.step,
                     run.strategy.dcp_state(run.optimizer), trainer_state, meta,
                     run.cfg.checkpoint.save_total_limit, run.monitor.best_by)
    run.log(f"[train] checkpoint {path}")
    return path


def check_resumable(meta: dict, path: Path, dist: DistributedConfig) -> None:
    """Exact resume needs the same world size (data shards, per-rank RNG) and the same
    strategy that actually ran (`resolved_strategy`: ddp with one process is single)."""
    world, strategy = dist.world_size, dist.resolved_strategy
    if meta.get("world_size") != world or meta.get("strategy", strategy) != strategy:
        raise PipelineError(
            f"checkpoint {path} was written by strategy {meta.get('strategy')} with world size "
            f"{meta.get('world_size')} but this run is {strategy} with world size {world}; "
            "resume with the same distributed.strategy and nproc_per_node x nnodes"
        )


def _main_decides(choose, d):
    """One process hashes the checkpoint files and tells the others which one to load."""
    path = choose() if d.is_main else None
    if d.world_size > 1:
        chosen = [path]
        torch.distributed.broadcast_object_list(chosen, src=d.main_rank)
        path = chosen[0]
    return path


def _load(run, path: Path) -> tuple[dict, dict]:
    optimizer, strategy = run.optimizer, run.strategy
    return ckpt.load(path, strategy.dcp_state(optimizer),
                     lambda state: strategy.load_dcp_state(optimizer, state))


def load_best(run) -> int | None:
    """load_best_model_at_end: the best kept checkpoint's weights become the trained model."""
    monitor = run.monitor
    path = _main_decides(lambda: ckpt.best(run.paths.checkpoints, monitor.best_by), run.dist)
    if path is None:
        run.log("[train] load_best_model_at_end: no checkpoint with a metric; keeping the "
                "final weights")
        return None
    _, meta = _load(run, path)
    run.log(f"[train] load_best_model_at_end: {path.name} ({monitor.metric} "
            f"{meta.get(monitor.metric):.6g})")
    return meta.get("step")


def resume(run) -> list[dict]:
    """Restore the run from its latest valid checkpoint; returns the logged rows it held."""
    directory = run.paths.checkpoints
    path = _main_decides(lambda: ckpt.latest(directory), run.dist)
    if path is None:
        run.log(f"[train] resume_from_checkpoint: no valid checkpoint in {directory}; "
                "starting from scratch")
        return []
    check_resumable(ckpt.read_meta(path) or {}, path, run.cfg.distributed)
    trainer_state, meta = _load(run, path)
    run.scheduler.load_state_dict(trainer_state["scheduler"])
    if run.scaler and trainer_state.get("scaler"):
        run.scaler.load_state_dict(trainer_state["scaler"])
    run.strategy.load_trainer_state(trainer_state.get("strategy", {}))
    run.monitor.load_state_dict(trainer_state.get("monitor", {}))
    run.progress.restore(meta)
    run.log(f"[train] resumed from {path} at step {run.progress.step}")
    return trainer_state.get("history", [])
