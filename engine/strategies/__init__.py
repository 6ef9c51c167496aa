"""Parallelism strategies behind one interface (see base.Strategy)."""

from __future__ import annotations

from engine.process.comm import CommMeter
from engine.process.distributed import Dist
from engine.strategies.base import Strategy, StrategySetup
from finetune.config import FinetuneConfig
from finetune.errors import PipelineError


def build_strategy(cfg: FinetuneConfig, d: Dist, meter: CommMeter) -> Strategy:
    """The strategy that runs: `distributed.resolved_strategy` (DDP and FSDP2 with one
    process are single-device), for the world size the job was launched with."""
    dist = cfg.distributed
    if d.world_size != dist.world_size:
        raise PipelineError(
            f"the job runs {d.world_size} processes but distributed.nproc_per_node x nnodes "
            f"is {dist.world_size}; launch it with the configured sizes")
    name = dist.resolved_strategy
    setup = StrategySetup.of(cfg)  # each strategy sees its part of the config, not all of it
    if name != dist.strategy and d.is_main:
        print(f"[train] strategy {dist.strategy} with world size 1: training single-device",
              flush=True)
    if name == "diloco":
        from engine.strategies.diloco import DiLoCoStrategy

        return DiLoCoStrategy(setup, d, meter)
    if name == "ddp":
        from engine.strategies.ddp import DDPStrategy

        return DDPStrategy(setup, d, meter)
    if name == "pipeline":
        from engine.strategies.pipeline import PipelineStrategy

        return PipelineStrategy(setup, d, meter)
    if name == "fsdp2":
        from engine.strategies.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(setup, d, meter)
    return Strategy(setup, d, meter)
