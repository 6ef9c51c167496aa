"""FSDP2: shard parameters, gradients and optimizer state with `fully_shard`.

Each transformer block is its own FSDP unit (found from the HF model's `_no_split_modules`, or
given as dotted paths), then the root; a block's parameters are all-gathered just before it
runs and freed after (reshard_after_forward), gradients are reduce-scattered.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from engine.modeling.construction import defer_to_meta, read_shards
from engine.modeling.model import DTYPES, base_model
from engine.process.comm import install_fsdp_counters
from engine.strategies.base import Placement, StoredWeights, Strategy
from finetune.config.distributed import FsdpConfig
from finetune.errors import PipelineError


def shard_units(model: torch.nn.Module, paths: list[str] | None) -> list[torch.nn.Module]:
    """The modules to shard one by one: named paths, or every transformer block."""
    if paths:
        units = []
        for path in paths:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                raise PipelineError(
                    f"distributed.fsdp.shard_modules: '{path}' is not a module of "
                    f"{type(model).__name__}"
                ) from None
            is_list = isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
            units.extend(module if is_list else [module])
        return units
    hf = base_model(model)
    block_names = set(getattr(hf, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in block_names]
    if not units:
        raise PipelineError(
            f"distributed.fsdp.shard_modules: {type(hf).__name__} names no transformer block "
            "class (_no_split_modules); list the blocks by dotted path, e.g. [model.layers]"
        )
    return units


class ShardedRead(Placement):
    """construct_model_on meta under FSDP2: the model stays weightless through the wrap
    (fully_shard shards meta parameters without allocating), then each rank reads only its
    shard of every stored tensor, onto the CPU with cpu_offload (where FSDP2 keeps the
    sharded parameters) else onto the device. What needs the weights waits for that read, so
    the batch-layout and loss probes run on the sharded model (every rank the same probe
    batch: its forward is collective)."""

    def __init__(self, model: torch.nn.Module, stored: StoredWeights, device: torch.device,
                 read_onto: torch.device):
        super().__init__(model)
        self.stored, self.read_onto = stored, read_onto
        self.sources = defer_to_meta(model, device)
        self.waiting: list = []  # (fn, [its result once run])

    def when_weights_exist(self, fn):
        box: list = []
        self.waiting.append((fn, box))

        def result():
            if not box:
                raise RuntimeError("ShardedRead: the weights are read in after_wrap, which "
                                   "has not run")
            return box[0]

        return result

    def after_wrap(self) -> dict:
        self.construction = read_shards(self.model, self.sources, self.stored.ref,
                                        self.stored.revision, self.read_onto)
        for fn, box in self.waiting:
            box.append(fn())
        return self.construction


class FSDP2Strategy(Strategy):
    name = "fsdp2"
    eval_lockstep = True

    def shares_prompt_forward(self) -> bool:
        """One forward per micro-batch (see Strategy.shares_prompt_forward)."""
        return False

    def generation_done(self, finished: torch.Tensor) -> bool:
        """When every rank's rows finished: each forward gathers the sharded weights, a
        collective every rank must join the same number of times, so all ranks stop together
        (one 1-element all-reduce per check)."""
        left = (~finished).sum().reshape(1).to(torch.int64)
        torch.distributed.all_reduce(left)
        return int(left) == 0

    def place(self, model, stored):
        """Built on meta: deferred to meta tensors now, this rank's shards read after the wrap
        (ShardedRead); otherwise as every strategy (to the device)."""
        if stored is None:
            return super().place(model, stored)
        c = self.setup.distributed.fsdp
        offload = c is not None and c.cpu_offload
        return ShardedRead(model, stored, self.d.device,
                           torch.device("cpu") if offload else self.d.device)

    def wrap(self, model, mesh=None):
        """Shard over `mesh` (default: all ranks; DiLoCo passes its worker group's mesh)."""
        c = self.setup.distributed.fsdp or FsdpConfig()
        if c.buffer_dtype:
            for module in model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    if buf.is_floating_point():
                        setattr(module, name, buf.to(DTYPES[c.buffer_dtype]))
        kwargs = {
            "mesh": mesh or init_device_mesh(self.d.device.type, (self.d.world_size,)),
            "reshard_after_forward": c.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=DTYPES.get(c.param_dtype), reduce_dtype=DTYPES.get(c.reduce_dtype)),
            "offload_policy": CPUOffloadPolicy(pin_memory=self.d.device.type == "cuda")
            if c.cpu_offload else OffloadPolicy(),
        }
        units = shard_units(model, c.shard_modules) if c.shard_transformer_layers else []
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                install_fsdp_counters(module, self.meter)
        self.model = model
        return model

    @contextlib.contextmanager
    def _no_reduce(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def sync_context(self, last_micro_batch: bool):
        return contextlib.nullcontext() if last_micro_batch else self._no_reduce()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm(max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_state_dict(self) -> dict:
        """Gather one tensor at a time (peak memory: one unsharded tensor), in the same order on
        every rank since each gather is a collective; only the main process keeps them. A PEFT
        export only needs the adapter, so only trainable tensors are gathered then."""
        sd = self.model.state_dict()
        names = self.trainable_names() if self.setup.trains_adapter else set(sd)
        full = {}
        for name in sorted(names):
            tensor = sd[name]
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.d.is_main:
                full[name] = tensor.detach().cpu()
        return full
