"""training.fused_loss_factory: a project's own fused linear cross entropy as the loss.

The factory ('module:function') is called once, with no arguments, and returns the loss
function `fn(hidden, weight, labels) -> summed loss`: `hidden` are the last hidden states of
the positions that predict a target (rows x hidden size; the prompt rows never reach it),
`weight` the output layer's weight (vocabulary x hidden size), `labels` those positions' target
ids (no -100 left). It returns the sum over the rows (a scalar tensor): the loop divides by the
step's target count over micro-batches and ranks, as for the built-in loss. Under autocast both
tensors come in the autocast dtype, as the model's own head would compute.

It is installed on the output layer as Liger's fused loss is (engine/objective/liger.py: the
head's forward returns the loss while the loop computes one), so DDP/FSDP2 hooks and compiled
blocks see an ordinary forward. A probe at start-up compares its loss and gradients on one
random batch with the full cross entropy and refuses with one line when they differ.
"""

from __future__ import annotations

import torch

from engine.modeling.model import base_model
from engine.objective.loss import (
    ChunkedLoss,
    FullLoss,
    PendingTargets,
    loss_and_grads,
    probe_batch,
    relative_errors,
)
from finetune.errors import PipelineError
from finetune.imports import load_object

KEY = "training.fused_loss_factory"


class FactoryLoss(ChunkedLoss):
    """The summed next-token loss from the factory's function, on the target rows only."""

    name = "fused_loss_factory"

    def __init__(self, model, device: torch.device, fn, ref: str):
        super().__init__(model, chunk_tokens=2**62, device=device)
        self.fn, self.ref = fn, ref

    def _summed(self, head_forward, flat: torch.Tensor, t: PendingTargets) -> torch.Tensor:
        if not t.chunks:  # nothing to predict: a zero that still uses the head (DDP wants it)
            return (head_forward(flat[:1]).sum() * 0).reshape(1, 1, 1)
        hidden, weight = flat.index_select(0, t.rows), self.head.weight
        if torch.is_autocast_enabled(hidden.device.type):
            fast = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(fast), weight.to(fast)
        loss = self.fn(hidden, weight, t.labels)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise PipelineError(f"{KEY}: the loss function from '{self.ref}' must return the "
                                f"summed loss as a scalar tensor (got {type(loss).__name__})")
        return loss.float().reshape(1, 1, 1)


def check_factory(ref: str):
    """The factory `ref` names, called with no arguments as this key calls it; one line for
    one that needs arguments (a factory of the model, `f(model)`, as Forgather writes one,
    is another contract: its loss replaces the model's forward, not the cross entropy of
    (hidden, weight, labels))."""
    import inspect

    factory = load_object(ref, KEY)
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise PipelineError(
            f"{KEY}: '{ref}' takes arguments {inspect.signature(factory)}; it must be called "
            "with none and return the loss function fn(hidden, weight, labels) -> summed "
            "cross entropy") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return factory


def factory_loss(model, ref: str, device: torch.device, amp: torch.dtype | None,
                 log) -> FactoryLoss:
    """The factory's loss on `model`'s output layer, after the probe agreed with the full
    cross entropy; one line when the head, the factory or the probe says no."""
    fn = check_factory(ref)()
    if not callable(fn):
        raise PipelineError(f"{KEY}: '{ref}' must return the loss function "
                            f"fn(hidden, weight, labels); it returned {type(fn).__name__}")
    base = base_model(model)
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise PipelineError(
            f"{KEY}: the output layer is a {type(head).__name__}"
            f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}, not a plain "
            "linear layer (an adapter on lm_head?), so (hidden, weight, labels) cannot compute "
            "it; leave lm_head out of peft.target_modules or remove fused_loss_factory")
    ids, labels = probe_batch(base.config.vocab_size)
    was_training = model.training
    model.eval()  # no dropout: both passes compute the same function
    try:
        full = loss_and_grads(model, FullLoss(), ids, labels, device, amp)
        loss = FactoryLoss(model, device, fn, ref)
        probed = loss_and_grads(model, loss, ids, labels, device, amp)
    finally:
        model.train(was_training)
    tolerance = 1e-3 if amp is None else 3e-2
    loss_error, grad_error = relative_errors(full, probed)
    if loss_error > tolerance or grad_error > tolerance:
        raise PipelineError(
            f"{KEY}: '{ref}' does not compute the summed cross entropy (probe loss "
            f"{probed[0]:.6g} vs {full[0]:.6g}, gradient error {grad_error:.2e}, tolerance "
            f"{tolerance:g}); it must return the sum over the rows, not the mean")
    log(f"[train] fused loss from {ref} (probe: loss error {loss_error:.1e}, gradient error "
        f"{grad_error:.1e})")
    return loss
