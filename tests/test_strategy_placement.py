"""What a strategy answers model setup, in process: the dtype its mixed precision computes
parameters in, and where it places this rank's part (on meta under FSDP2: read after the wrap,
with what needs the weights waiting for that read)."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT

from engine.modeling.model import load_base_model, resolve_model_ref
from engine.process.comm import CommMeter
from engine.process.distributed import Dist
from engine.strategies import build_strategy
from engine.strategies.base import StoredWeights, Strategy, StrategySetup
from finetune.config.schema import FinetuneConfig

CPU = torch.device("cpu")


def _config(distributed: dict) -> FinetuneConfig:
    return FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"},
                                          "distributed": distributed})


def _dist(world_size: int) -> Dist:
    return Dist(rank=0, local_rank=0, world_size=world_size, local_world_size=world_size,
                device=CPU)


def test_param_dtype_is_fsdp2_mixed_precision_and_none_without_it():
    """Built as the worker builds them (no process group: constructors communicate nothing)."""
    def built(distributed: dict) -> Strategy:
        cfg = _config(distributed)
        return build_strategy(cfg, _dist(cfg.distributed.world_size), CommMeter())

    single, ddp = built({}), built({"strategy": "ddp", "nproc_per_node": 2})
    assert (single.name, single.param_dtype) == ("single", None)
    assert (ddp.name, ddp.param_dtype) == ("ddp", None)
    fsdp2 = built({"strategy": "fsdp2", "nproc_per_node": 2,
                   "fsdp": {"param_dtype": "bfloat16"}})
    assert (fsdp2.name, fsdp2.param_dtype) == ("fsdp2", torch.bfloat16)
    plain = built({"strategy": "fsdp2", "nproc_per_node": 2, "fsdp": {"reduce_dtype": "float32"}})
    assert (plain.name, plain.param_dtype) == ("fsdp2", None)
    # fsdp2 at world size 1 runs single-device; its section still picks the bf16 CPU kernels
    # (as model setup did when it read the section itself)
    alone = built({"strategy": "fsdp2", "fsdp": {"param_dtype": "bfloat16"}})
    assert (alone.name, alone.param_dtype) == ("single", torch.bfloat16)


def _stories(construct: str = "default"):
    cfg = _config({})
    return cfg, load_base_model(cfg.model, ROOT, construct=construct)


def test_single_places_on_the_device_or_reads_the_checkpoint_before_the_wrap():
    cfg, want = _stories()
    strategy = Strategy(StrategySetup.of(cfg), _dist(1), CommMeter())
    stored = StoredWeights(resolve_model_ref(cfg.model.name_or_path, ROOT), cfg.model.revision)
    for construct, weights in (("default", None), ("meta", stored)):
        _, model = _stories(construct)
        placement = strategy.place(model, weights)
        seen = []
        probed = placement.when_weights_exist(
            lambda: seen.append(placement.model.state_dict()) or "probed")
        assert len(seen) == 1  # at once: the weights are there before the wrap
        strategy.wrap(placement.model)
        construction = placement.after_wrap()
        assert probed() == "probed"
        assert (construction.get("construct_tensors_read", 0) > 0) == (weights is not None)
        assert all(torch.equal(t, seen[0][k]) for k, t in want.state_dict().items())


def test_fsdp2_on_meta_reads_its_shards_after_the_wrap_and_the_probes_wait(tmp_path):
    """A one-process gloo group: FSDP2 shards the weightless model, then the shards are read
    (here: the whole tensors) and only then does what needs the weights run."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from engine.strategies.fsdp2 import FSDP2Strategy

    cfg, want = _stories()
    _, model = _stories("meta")
    fsdp_cfg = _config({"strategy": "fsdp2", "fsdp": {"cpu_offload": True}})
    stored = StoredWeights(resolve_model_ref(cfg.model.name_or_path, ROOT), cfg.model.revision)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        strategy = FSDP2Strategy(StrategySetup.of(fsdp_cfg), _dist(1), CommMeter())
        placement = strategy.place(model, stored)
        assert all(p.is_meta for p in model.parameters())  # deferred: nothing read yet
        seen = []
        probed = placement.when_weights_exist(lambda: seen.append(
            {k: v.full_tensor() if isinstance(v, DTensor) else v
             for k, v in model.state_dict().items()}) or "probed")
        assert seen == []
        with pytest.raises(RuntimeError, match="after_wrap"):
            probed()
        strategy.wrap(model)
        assert seen == [] and all(p.is_meta for p in model.parameters())
        construction = placement.after_wrap()
        assert probed() == "probed" and construction["construct_tensors_read"] > 0
        assert all(torch.equal(t, seen[0][k]) for k, t in want.state_dict().items())
    finally:
        dist.destroy_process_group()


def test_strategy_optimizers_name_diloco_outer_optimizer_before_any_strategy_exists():
    from engine.strategies import strategy_optimizers

    assert strategy_optimizers(_config({}).distributed) == []
    diloco = FinetuneConfig.model_validate({
        "data": {"json_file_path": "x.jsonl"}, "training": {"max_steps": 4},
        "eval": {"eval_steps": 2}, "checkpoint": {"save_steps": 2},
        "distributed": {"strategy": "diloco", "nproc_per_node": 2, "diloco": {
            "inner_steps": 2, "diloco_loops": 2, "outer_optimizer": "Adam"}}})
    assert strategy_optimizers(diloco.distributed) == [
        ("Adam", "distributed.diloco.outer_optimizer")]


def test_every_strategy_the_config_accepts_is_one_registry_line():
    """`distributed.strategy`'s values are the STRATEGIES registry's names, each naming a
    Strategy subclass whose `name` is that value (a new strategy: one module and one line)."""
    from typing import get_args

    from engine.strategies import STRATEGIES
    from finetune.config.distributed import DistributedConfig

    accepted = get_args(DistributedConfig.model_fields["strategy"].annotation)
    assert sorted(accepted) == sorted(STRATEGIES.names())
    for name in accepted:
        cls = STRATEGIES.get(name)
        assert issubclass(cls, Strategy) and cls.name == name, (name, cls)
