"""DDP: replicate the model, all-reduce gradients in buckets during backward."""

from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel

from engine.process.comm import ddp_counting_hook
from engine.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def shares_prompt_forward(self) -> bool:
        """One forward per micro-batch (see Strategy.shares_prompt_forward)."""
        return False

    def wrap(self, model):
        c = self.setup.distributed
        self.model = DistributedDataParallel(
            model,
            device_ids=[self.d.local_rank] if self.d.device.type == "cuda" else None,
            bucket_cap_mb=c.bucket_cap_mb,
            find_unused_parameters=c.find_unused_parameters,
            gradient_as_bucket_view=c.gradient_as_bucket_view,
            static_graph=c.static_graph,
            forward_sync_buffers=c.broadcast_buffers,
            init_sync=c.init_sync,
            skip_all_reduce_unused_params=c.skip_all_reduce_unused_params,
        )
        # Same averaging all-reduce as DDP's default, with the bytes counted.
        self.model.register_comm_hook(self.meter, ddp_counting_hook)
        return self.model

    @property
    def module(self):
        return self.model.module

    def sync_context(self, last_micro_batch: bool):
        return contextlib.nullcontext() if last_micro_batch else self.model.no_sync()
