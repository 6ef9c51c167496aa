"""training.use_liger_kernel: Liger's Triton kernels in place of the model's own.

Two parts, both the liger-kernel package's code, not ours:
- the model's RMSNorm, RoPE and SwiGLU, patched by Liger's own entry point for the model's
  family (`_apply_liger_kernel_to_instance`, what HF's Trainer calls for its
  `use_liger_kernel`); a family Liger does not list is refused with one line;
- the loss: Liger's fused linear cross entropy takes the output layer's weight and the hidden
  states of the positions that predict a target, and computes the summed loss chunk by chunk
  with the gradients in the same pass, so the logits never exist. It is installed on the output
  layer the way engine.objective.loss.ChunkedLoss is (the head's forward returns the loss while the
  loop computes one), so DDP/FSDP2 hooks and compiled blocks see an ordinary forward.

A probe at start-up runs one random batch through the unpatched model (loss and every trainable
gradient), patches, runs it again, and refuses with one line if the two differ by more than the
precision allows. Liger's kernels need CUDA (the machine rows of finetune/config/compat.py
refuse a CPU before this runs).
"""

from __future__ import annotations

import torch

from engine.datapath.data import IGNORE_INDEX
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

KEY = "training.use_liger_kernel"
INSTALL = "pip install 'finetune-pipeline[liger]' (liger-kernel)"


class LigerLoss(ChunkedLoss):
    """The summed next-token loss from Liger's fused linear cross entropy, on the target rows
    only (completion-only labels: the prompt rows are never multiplied by the head)."""

    name = "liger_fused_linear_cross_entropy"

    def __init__(self, model, device: torch.device):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        super().__init__(model, chunk_tokens=2**62, device=device)
        self.fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX,
                                                      reduction="sum")

    def _summed(self, head_forward, flat: torch.Tensor, t: PendingTargets) -> torch.Tensor:
        head = self.head
        if not t.chunks:  # nothing to predict: a zero that still uses the head (DDP wants it)
            return (head_forward(flat[:1]).sum() * 0).reshape(1, 1, 1)
        hidden = flat.index_select(0, t.rows)
        if torch.is_autocast_enabled(hidden.device.type):
            # Liger's kernel multiplies in the input's dtype: the autocast one, as the
            # model's own head would under autocast
            fast = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(fast), head.weight.to(fast)
            bias = head.bias.to(fast) if head.bias is not None else None
        else:
            weight, bias = head.weight, head.bias
        return self.fused(weight, hidden, t.labels, bias).float().reshape(1, 1, 1)


def _families() -> dict:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise PipelineError(f"{KEY}: the liger-kernel package is not installed ({exc}); "
                            f"{INSTALL}, or set it false") from exc
    return MODEL_TYPE_TO_APPLY_LIGER_FN


def apply_liger(model, device: torch.device, amp: torch.dtype | None, log) -> LigerLoss:
    """Patch `model` with Liger's kernels for its family and return the fused loss, after the
    probe agreed; one line (PipelineError) when the family, the head or the probe says no."""
    families = _families()
    base = base_model(model)
    family = getattr(getattr(base, "config", None), "model_type", None)
    if family not in families:
        raise PipelineError(f"{KEY}: Liger has no kernels for model type '{family}' (it covers "
                            f"{', '.join(sorted(families))}); set it false")
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise PipelineError(f"{KEY}: the output layer is a {type(head).__name__}, not a plain "
                            "linear layer (an adapter on lm_head?), so the fused linear cross "
                            "entropy cannot take its weight; leave lm_head out of "
                            "peft.target_modules or set it false")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    ids, labels = probe_batch(base.config.vocab_size)
    was_training = model.training
    model.eval()  # no dropout: both passes compute the same function
    try:
        before, before_grads = loss_and_grads(model, FullLoss(), ids, labels, device, amp)
        _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True,
                                        cross_entropy=False, fused_linear_cross_entropy=False)
        loss = LigerLoss(model, device)
        after, after_grads = loss_and_grads(model, loss, ids, labels, device, amp)
    finally:
        model.train(was_training)
    tolerance = 1e-3 if amp is None else 3e-2
    loss_error, grad_error = relative_errors((before, before_grads), (after, after_grads))
    if loss_error > tolerance or grad_error > tolerance:
        raise PipelineError(
            f"{KEY}: Liger's kernels change this model's results (probe loss {after:.6g} vs "
            f"{before:.6g}, gradient error {grad_error:.2e} > {tolerance:g}); set it false")
    log(f"[train] liger: {family} RMSNorm, RoPE and SwiGLU patched, fused linear cross "
        f"entropy loss (probe: loss error {loss_error:.1e}, gradient error {grad_error:.1e})")
    return loss
