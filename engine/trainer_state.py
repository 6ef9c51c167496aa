"""What the loop puts in a checkpoint and takes back: position, scheduler, scaler, strategy
extras, monitor, metric history; resume, and load_best_model_at_end.

The storage format (DCP folders, hashes, rotation) is engine.checkpoint; this module decides
the contents, so exact resume is one reviewable place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine import checkpoint as ckpt
from engine.monitor import Monitor
from engine.reporters import History
from engine.strategies import Strategy
from finetune.errors import PipelineError


@dataclass
class Position:
    """Where the data stream is: resume restores exactly this."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0


def history_rows(reporters) -> list[dict]:
    return reporters.find(History).rows if reporters else []


def save(directory, cfg, strategy: Strategy, optimizer, scheduler, scaler, pos, d,
         reporters, monitor: Monitor, evaluated: dict) -> Path:
    trainer_state = {
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler else None,
        "strategy": strategy.trainer_state(),
        "history": history_rows(reporters),
        "monitor": monitor.state_dict(),
    }
    meta = {**pos.__dict__, "world_size": d.world_size, "strategy": strategy.name, **evaluated}
    path = ckpt.save(directory, pos.step, strategy.dcp_state(optimizer), trainer_state, meta,
                     cfg.checkpoint.save_total_limit, monitor.best_by)
    if d.is_main:
        print(f"[train] checkpoint {path}", flush=True)
    return path


def check_resumable(meta: dict, path: Path, world_size: int, strategy: str) -> None:
    """Exact resume needs the same world size (data shards, per-rank RNG) and strategy."""
    if meta.get("world_size") != world_size or meta.get("strategy", strategy) != strategy:
        raise PipelineError(
            f"checkpoint {path} was written by strategy {meta.get('strategy')} with world size "
            f"{meta.get('world_size')} but this run is {strategy} with world size {world_size}; "
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


def load_best(directory, strategy: Strategy, optimizer, monitor: Monitor, d) -> int | None:
    """load_best_model_at_end: the best kept checkpoint's weights become the trained model."""
    path = _main_decides(lambda: ckpt.best(directory, monitor.best_by), d)
    if path is None:
        if d.is_main:
            print("[train] load_best_model_at_end: no checkpoint with a metric; keeping the "
                  "final weights", flush=True)
        return None
    _, meta = ckpt.load(path, strategy.dcp_state(optimizer),
                        lambda state: strategy.load_dcp_state(optimizer, state))
    if d.is_main:
        print(f"[train] load_best_model_at_end: {path.name} ({monitor.metric} "
              f"{meta.get(monitor.metric):.6g})", flush=True)
    return meta.get("step")


def resume(directory, strategy: Strategy, optimizer, scheduler, scaler, d,
           monitor: Monitor) -> tuple[Position, list]:
    path = _main_decides(lambda: ckpt.latest(directory), d)
    if path is None:
        if d.is_main:
            print(f"[train] resume_from_checkpoint: no valid checkpoint in {directory}; "
                  "starting from scratch", flush=True)
        return Position(), []
    meta = ckpt.read_meta(path) or {}
    check_resumable(meta, path, d.world_size, strategy.name)
    trainer_state, meta = ckpt.load(path, strategy.dcp_state(optimizer),
                                    lambda state: strategy.load_dcp_state(optimizer, state))
    scheduler.load_state_dict(trainer_state["scheduler"])
    if scaler and trainer_state.get("scaler"):
        scaler.load_state_dict(trainer_state["scaler"])
    strategy.load_trainer_state(trainer_state.get("strategy", {}))
    monitor.load_state_dict(trainer_state.get("monitor", {}))
    pos = Position(**{k: meta[k] for k in ("step", "epoch", "batch_in_epoch", "tokens_seen")})
    if d.is_main:
        print(f"[train] resumed from {path} at step {pos.step}", flush=True)
    return pos, trainer_state.get("history", [])
