"""Parallelism strategies behind one interface (see base.Strategy).

The strategies' config sections (`distributed.fsdp`, `.diloco`, `.pipeline`) are read in this
package only; code that must decide something from them before a strategy exists asks a
function here. This module imports no strategy until `build_strategy` runs (the base pulls in
torch's checkpointing and the evaluation loop), so `finetune validate` can ask it cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from finetune.config.distributed import DistributedConfig
from finetune.errors import PipelineError
from finetune.registry import Registry

if TYPE_CHECKING:
    from engine.process.comm import CommMeter
    from engine.process.distributed import Dist
    from engine.strategies.base import Strategy
    from finetune.config import FinetuneConfig


#: `distributed.strategy` (as `distributed.resolved_strategy` gives it) -> its class, imported
#: on first lookup; a new strategy is one module in this package and one line here
STRATEGIES: Registry[type[Strategy]] = Registry(
    "strategy", "distributed.strategy", base="engine.strategies.base:Strategy", built_ins={
        "single": "engine.strategies.base:Strategy",
        "ddp": "engine.strategies.ddp:DDPStrategy",
        "fsdp2": "engine.strategies.fsdp2:FSDP2Strategy",
        "diloco": "engine.strategies.diloco:DiLoCoStrategy",
        "pipeline": "engine.strategies.pipeline:PipelineStrategy",
    })


def __getattr__(name: str):
    """`Strategy` and `StrategySetup`, imported when first asked for."""
    if name in ("Strategy", "StrategySetup"):
        from engine.strategies import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def strategy_optimizers(dist: DistributedConfig) -> list[tuple[str, str]]:
    """(class reference, params key) of each optimizer the strategy builds besides
    `optimizer.name`: DiLoCo's outer optimizer. For checks before launch (a 'module:Class'
    reference must load), when no strategy exists yet."""
    if dist.diloco is None:
        return []
    return [(dist.diloco.outer_optimizer, "distributed.diloco.outer_optimizer")]


def check_strategy_optimizers(dist: DistributedConfig) -> None:
    """The strategy's own optimizers take what the params give them: DiLoCo's outer momentum
    keys go to SGD by its class, and are refused for another (before launch, not in a
    worker)."""
    if dist.diloco is None:
        return
    from engine.objective.optim import optimizer_class

    c = dist.diloco
    c.outer_optimizer_kwargs(optimizer_class(c.outer_optimizer,
                                             "distributed.diloco.outer_optimizer"))


def build_strategy(cfg: FinetuneConfig, d: Dist, meter: CommMeter) -> Strategy:
    """The strategy that runs: `distributed.resolved_strategy` (DDP and FSDP2 with one
    process are single-device), for the world size the job was launched with."""
    from engine.strategies.base import StrategySetup

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
    return STRATEGIES.get(name)(setup, d, meter)
