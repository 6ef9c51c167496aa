"""bf16 linear layers on CPU with GEMM layouts the CPU runs fast.

Why: on CPUs without native bf16 matmul units (no AVX512-BF16/AMX, e.g. the AVX2 machines CI and
most laptops have) torch's bf16 GEMM speed depends on operand layout by more than 10x. Measured on
the 2-core AVX2 dev machine at the 20M bench model's shapes: A @ B with both operands contiguous
("NN") runs 0.9-2.3 GFLOP/s, while the same product with one operand transposed ("NT"/"TN") runs
13-23 GFLOP/s. Autograd's linear backward computes the input gradient as `grad @ W` with W
contiguous: NN, the slow one, in every linear layer of every step. That made bf16 training ~25x
slower than fp32 here.

`LayoutAwareLinear` computes the same three products (y = x W^T, dx = g W, dW = g^T x) but hands
the input-gradient GEMM a transposed copy of W, so all three run NT/TN. The copy is
out*in elements per layer per backward, small next to the tokens*out*in GEMM. Forward is
`F.linear` unchanged, so losses are the same; gradients differ only by bf16 rounding order.

Applied only where it matters (CPU, bf16 compute, no native bf16 GEMM) and by instance
`forward`, so checkpoints, adapters, FSDP2 and torch.compile see the same modules and
parameters. A CPU with AVX512-BF16 or AMX runs bf16 GEMMs natively through oneDNN, in every
layout at the same speed (the 2-core AMD EPYC with AVX512-BF16: 830-940 GFLOP/s for NN, NT and
TN at 4096x576x1536, 4.5x its fp32), so there the stock linear is kept: the transposed copy
would only cost, and the LoRA layers stay plain for `training.fused_lora`. With oneDNN capped
below those instructions (portable numerics' `ONEDNN_MAX_CPU_ISA=AVX2`) the same CPU runs NN at
3 GFLOP/s and NT at 48, so the cap counts, not the CPU alone.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


class LayoutAwareLinear(torch.autograd.Function):
    """y = x @ w.T + b, with a backward whose GEMMs avoid the slow bf16 NN layout."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # weight.t().contiguous().t() is W with column-major strides: g @ it runs NT
            w_cm = weight.t().contiguous().t()
            grad_x = (g @ w_cm).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ x.reshape(-1, x.shape[-1])  # TN
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def _layout_aware_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled("cpu"):
        # do autocast's cast ourselves (the same bf16 copies it would make), then call the
        # Function with autocast off so its GEMMs run on exactly these tensors
        dtype = torch.get_autocast_dtype("cpu")
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast("cpu", enabled=False):
            return LayoutAwareLinear.apply(x.to(dtype), self.weight.to(dtype), bias)
    return LayoutAwareLinear.apply(x, self.weight, self.bias)


def computes_in_bf16_on_cpu(model: nn.Module, device: torch.device,
                            compute_dtypes: set[torch.dtype | None]) -> bool:
    """True when this run's linear layers multiply bf16 on a CPU: autocast bf16 or FSDP2's
    bf16 param_dtype (`compute_dtypes`), or bf16 weights (`model.dtype: bfloat16`)."""
    if device.type != "cpu":
        return False
    return torch.bfloat16 in compute_dtypes or any(
        p.dtype == torch.bfloat16 for p in model.parameters())


#: oneDNN ISA ceilings (ONEDNN_MAX_CPU_ISA) that still allow its native bf16 instructions
_BF16_ISA_PREFIXES = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10")
#: CPU flags that give oneDNN native bf16 dot products
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16_gemm(flags: str | None = None, env: dict | None = None) -> bool:
    """Whether bf16 GEMMs run natively here, in every operand layout: the CPU has AVX512-BF16 or
    AMX-BF16 (`flags`: finetune.numerics.cpu()'s comma list by default) and oneDNN is not capped
    below them (`env`: os.environ by default)."""
    if flags is None:
        from finetune.numerics import cpu

        flags = cpu()["flags"]
    ceiling = (os.environ if env is None else env).get("ONEDNN_MAX_CPU_ISA", "").upper()
    allowed = ceiling in ("", "ALL", "DEFAULT") or ceiling.startswith(_BF16_ISA_PREFIXES)
    return allowed and any(f in flags.split(",") for f in _BF16_FLAGS)


def use_layout_aware_linear(model: nn.Module) -> int:
    """Route every `nn.Linear` of `model` (adapters' included) through `LayoutAwareLinear`;
    returns how many. Undo with `restore_linear`."""
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    for layer in layers:
        layer.forward = _layout_aware_forward.__get__(layer)
    return len(layers)


def restore_linear(model: nn.Module) -> None:
    for m in model.modules():
        if type(m) is nn.Linear and "forward" in m.__dict__:
            del m.forward
