"""LoRA linear layers as one autograd node: the scale folded into the rank-r products and the
adapter's output added inside the GEMM, forward and backward.

Why: peft computes `base(x) + lora_B(lora_A(x)) * scaling`. Besides the three products, that is
an elementwise multiply and an add over the whole (tokens x out) output in the forward, and in
the backward another multiply of the (tokens x out) gradient by the scale plus an add of the two
(tokens x in) input gradients, per adapted layer. Those passes only move memory: measured on
the 2-core CPU dev machine (bench/peers_cpu.py's SmolLM2-135M-shape LoRA row, torch.profiler)
they were 4.4% of the step (aten::mul + aten::add); on a GPU the same launches and passes over
memory are a larger share of a LoRA step, which is why Unsloth writes its LoRA layers by hand.

`FusedLoraLinear` computes exactly peft's function with the same three products and no
(tokens x out) or (tokens x in) elementwise pass:

    forward:   y = x W^T + b,  then  y += s * (x A^T) B^T        (addmm_, alpha = s)
    backward:  d(xA) = s * (g B)                                  (tokens x r: small)
               dB = s * g^T (x A^T),   dA = d(xA)^T x
               dx = g W,  then  dx += d(xA) A                      (addmm_)

It saves what peft's graph saves (the input and the rank-r activation). Results equal peft's up
to float rounding (the same products; the scale is applied to r-wide tensors instead of
out-wide ones, exact when s is a power of two). tests/test_fused_lora.py checks the loss and
every gradient against peft itself.

It is installed per layer by instance `forward` (like engine/modeling/cpu_linear.py), so peft,
checkpoints, FSDP2, DDP and torch.compile see the same modules and parameters, and it applies
only where it is peft's plain case: one active adapter, not merged or disabled, no DoRA or
other variant, no dropout while training, no adapter bias, an ordinary `nn.Linear` base (not
quantized, not fp8, not already re-routed) with matching dtypes. Anything else, checked on
every call, goes through peft's own forward unchanged: turning an adapter off (DPO's reference
pass), merging it or switching adapters needs no re-install.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLoraLinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T with the elementwise passes folded into the GEMMs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        xa = flat @ lora_a.t()  # tokens x r
        out = F.linear(flat, weight, bias)
        out.addmm_(xa, lora_b.t(), alpha=scale)
        ctx.save_for_backward(flat, weight, lora_a, lora_b, xa)
        ctx.scale, ctx.has_bias, ctx.in_shape = scale, bias is not None, x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, weight, lora_a, lora_b, xa = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_lb = ctx.needs_input_grad[:5]
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_bias = grad_a = grad_lb = None
        if need_x or need_a:
            grad_xa = (g @ lora_b).mul_(ctx.scale)  # tokens x r
            if need_a:
                grad_a = grad_xa.t() @ flat
            if need_x:
                grad_x = (g @ weight).addmm_(grad_xa, lora_a).view(ctx.in_shape)
        if need_lb:
            grad_lb = (g.t() @ xa).mul_(ctx.scale)
        if need_w:
            grad_w = g.t() @ flat
        if ctx.has_bias and need_b:
            grad_bias = g.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_lb, None


def _plain_case(layer, args: tuple, kwargs: dict):
    """(weight, bias, A, B, scale) when `layer` (a peft lora.Linear) computes plain LoRA on this
    call, else None (peft's own forward then runs)."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    # DoRA and peft's other variants live in lora_variant
    if name not in layer.lora_A or name in layer.lora_variant or layer.fan_in_fan_out:
        return None
    dropout = layer.lora_dropout[name]
    if not (isinstance(dropout, nn.Identity) or not dropout.training):
        return None
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if (type(base) is not nn.Linear or "forward" in base.__dict__ or base._forward_hooks
            or base._forward_pre_hooks or type(lora_a) is not nn.Linear
            or type(lora_b) is not nn.Linear or lora_b.bias is not None
            or lora_a.bias is not None):
        return None
    return base.weight, base.bias, lora_a.weight, lora_b.weight, layer.scaling[name]


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft lora.Linear's forward (bound to the layer by `use_fused_lora`)."""
    parts = _plain_case(self, args, kwargs)
    if parts is None:
        return type(self).forward(self, x, *args, **kwargs)
    weight, bias, lora_a, lora_b, scale = parts
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # autocast's own casts (all operands to its dtype), then the GEMMs with it off
        dtype = torch.get_autocast_dtype(device)
        tensors = [t if t is None else t.to(dtype) for t in (x, weight, bias, lora_a, lora_b)]
        with torch.autocast(device, enabled=False):
            return FusedLoraLinear.apply(*tensors, scale)
    if any(t is not None and t.dtype != x.dtype for t in (weight, bias, lora_a, lora_b)):
        return type(self).forward(self, x, *args, **kwargs)  # peft casts between the two
    return FusedLoraLinear.apply(x, weight, bias, lora_a, lora_b, scale)


def is_fused(layer: nn.Module) -> bool:
    return getattr(layer.__dict__.get("forward"), "__func__", None) is _fused_forward


def lora_linears(model: nn.Module) -> list[nn.Module]:
    """peft's LoRA linear layers of `model` (none without peft)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return []
    return [m for m in model.modules() if type(m) is Linear]


def use_fused_lora(model: nn.Module) -> int:
    """Route every peft LoRA linear layer of `model` through `FusedLoraLinear` where it is the
    plain case (checked per call); returns how many layers were switched."""
    layers = lora_linears(model)
    for layer in layers:
        layer.forward = _fused_forward.__get__(layer)  # a bound method: deepcopy rebinds it
    return len(layers)


def restore_lora_forward(model: nn.Module) -> None:
    """Undo `use_fused_lora`: peft's own forward again."""
    for layer in lora_linears(model):
        if is_fused(layer):
            del layer.forward
