"""Communication accounting: bytes each rank hands to training collectives.

This is the figure that makes DDP, FSDP2 and DiLoCo comparable. It is measured where the bytes
go, not estimated: DDP through a gradient comm hook (its C++ reducer never calls Python
collectives), FSDP2 through its custom all-gather / reduce-scatter hooks, DiLoCo and the loss
normalisation through `all_reduce` below. The unit is the payload a rank passes in (an
all-reduce of N bytes counts N; a ring implementation moves about 2(W-1)/W of that per rank).
One-time setup (DDP's initial broadcast) and metric/eval reductions are not training traffic
and are not counted.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class CommMeter:
    """Byte counters by collective kind, with a running total and a per-window delta."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = defaultdict(int)
        self.total = 0
        self._window_start = 0
        self.paused = False

    @contextlib.contextmanager
    def pause(self):
        """Evaluation forwards (FSDP2 gathers params for them too) are not training traffic."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.add_bytes(kind, tensor.numel() * tensor.element_size())

    def add_bytes(self, kind: str, n: int) -> None:
        """Bytes, counted by size (pipeline activations are sent inside torch's schedules,
        where the meter does not see the tensors)."""
        if self.paused:
            return
        self.by_kind[kind] += n
        self.total += n

    def take_window(self) -> int:
        """Bytes since the previous call (per logging window)."""
        delta = self.total - self._window_start
        self._window_start = self.total
        return delta

    def summary(self, steps: int) -> dict[str, float]:
        out = {"comm_bytes_total": float(self.total),
               "comm_bytes_per_step": self.total / max(steps, 1)}
        out.update({f"comm_bytes_{k}": float(v) for k, v in sorted(self.by_kind.items())})
        return out


def all_reduce(tensor: torch.Tensor, meter: CommMeter | None, kind: str = "all_reduce",
               group=None) -> None:
    """In-place SUM all-reduce (over `group`, default all ranks), counted when a meter is given."""
    if meter is not None:
        meter.add(kind, tensor)
    dist.all_reduce(tensor, group=group)


def all_reduce_count(value: float, meter: CommMeter | None, kind: str, device: torch.device,
                     group=None, on_device: bool = False) -> float | torch.Tensor:
    """A count (target tokens) summed over `group` as one float64: exact for integers.
    `on_device`: the sum stays a 0-dim device tensor, so the host does not wait for the
    collective (and the GPU work queued before it) to use it in the step's math."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    all_reduce(t, meter, kind, group=group)
    return t[0] if on_device else float(t.item())


def all_reduce_flat(tensors: list[torch.Tensor], meter: CommMeter | None, kind: str,
                    group=None, divide: float = 1.0) -> None:
    """Several tensors (gradients) summed over `group` in one collective on a flat copy, each
    divided by `divide` first (an average), written back in place."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if divide != 1.0:
        flat.div_(divide)
    all_reduce(flat, meter, kind, group=group)
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))


def ddp_counting_hook(meter, bucket):
    """DDP's default averaging all-reduce, with the bucket's bytes counted. (No annotations:
    DDP rejects any return annotation but the exact Future[Tensor] object, and this module's
    postponed annotations are strings.)"""
    meter.add("ddp_grad_all_reduce", bucket.buffer())
    return default_hooks.allreduce_hook(None, bucket)


def install_fsdp_counters(module, meter: CommMeter) -> None:
    """Count FSDP2's parameter all-gathers and gradient reduce-scatters on `module`."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            meter.add("fsdp_all_gather", input_tensor)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            meter.add("fsdp_reduce_scatter", input_tensor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    module.set_custom_all_gather(CountingAllGather())
    module.set_custom_reduce_scatter(CountingReduceScatter())
