"""The optimizer step inside backward (`training.fuse_optim_with_backward`, torchtune's
optimizer-in-backward): each parameter is updated by a hook as soon as its gradient is
accumulated, and the gradient is freed right away, so a step never holds every gradient at
once (peak memory: one parameter's gradient instead of all of them).

The run keeps its one ordinary optimizer (so checkpoints, resume and the scheduler are the
same code): the hook calls `optimizer.step()` while only that parameter has a gradient, and
per-parameter optimizers (Adam, SGD, ...) update exactly the parameters that have one. What
needs every gradient before the update cannot run this way and is refused before launch:
gradient clipping (max_grad_norm), accumulation, fp16's GradScaler, and the gradient
all-reduce of DDP/FSDP2/DiLoCo.
"""

from __future__ import annotations

import torch


class OptimizerInBackward:
    """Installs the hooks on the trainable parameters of `module` for `optimizer`."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.handles = [p.register_post_accumulate_grad_hook(self._step)
                        for p in module.parameters() if p.requires_grad]

    def _step(self, param: torch.Tensor) -> None:
        self.optimizer.step()
        param.grad = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
