"""Parallelism strategies behind one interface (see base.Strategy)."""

from __future__ import annotations

from engine.comm import CommMeter
from engine.distributed import Dist
from engine.strategies.base import Strategy
from finetune.config import FinetuneConfig


def build_strategy(cfg: FinetuneConfig, d: Dist, meter: CommMeter) -> Strategy:
    """The configured strategy; DDP and FSDP2 with one process degrade to single-device."""
    name = cfg.distributed.strategy
    if name == "diloco":
        from engine.strategies.diloco import DiLoCoStrategy

        return DiLoCoStrategy(cfg, d, meter)
    if d.world_size == 1:
        if name != "single" and d.is_main:
            print(f"[train] strategy {name} with world size 1: training single-device",
                  flush=True)
        return Strategy(cfg, d, meter)
    if name == "ddp":
        from engine.strategies.ddp import DDPStrategy

        return DDPStrategy(cfg, d, meter)
    if name == "fsdp2":
        from engine.strategies.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(cfg, d, meter)
    raise AssertionError(f"strategy {name} with world size {d.world_size}")
