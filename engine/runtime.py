"""Process-wide torch settings and model transforms chosen in `training`: determinism, matmul
precision, anomaly detection, gradient checkpointing, torch.compile, bf16 CPU kernels.

Each is one call here so the loop reads as a recipe and tests can apply exactly what a training
run applies.
"""

from __future__ import annotations

import os

import torch

from engine.cpu_linear import computes_in_bf16_on_cpu, use_layout_aware_linear
from engine.model import DTYPES
from finetune.config.distributed import DistributedConfig
from finetune.config.schema import TrainingConfig
from finetune.errors import PipelineError


def autocast_dtype(t: TrainingConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `mixed_precision`; fp16 off CUDA is refused (the stage calls
    this before launching, so the refusal comes before any process starts)."""
    mp = t.mixed_precision
    if mp == "fp16" and device.type != "cuda":
        raise PipelineError(
            "training.mixed_precision: fp16 on CPU is refused (about 100x slower than fp32 "
            "here); use bf16 or fp32"
        )
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)


def configure_torch(t: TrainingConfig) -> None:
    """Global flags, set before the model is built."""
    torch.set_float32_matmul_precision(t.float32_matmul_precision)
    if t.full_determinism:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.autograd.set_detect_anomaly(t.detect_anomaly, check_nan=True)


def enable_gradient_checkpointing(model, t: TrainingConfig) -> None:
    """On the base model (before the adapter): HF's hook-based checkpointing per block."""
    if not t.gradient_checkpointing:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise PipelineError(
            f"training.gradient_checkpointing: {type(model).__name__} does not support it; "
            "set it to false"
        )
    kwargs = t.gradient_checkpointing_kwargs.model_dump()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if kwargs["use_reentrant"]:
        # reentrant checkpointing only backpropagates into blocks whose *inputs* need grad;
        # with frozen embeddings (adapters) that is never, so make the embeddings' output need it
        model.enable_input_require_grads()


def use_fast_bf16_cpu_kernels(model, device: torch.device, amp: torch.dtype | None,
                              dist: DistributedConfig) -> int:
    """bf16 on a CPU: linear layers whose backward avoids the slow GEMM layout (see
    engine/cpu_linear.py); returns how many layers were switched (0: not a bf16 CPU run)."""
    # the config admits a `fsdp` section only where it applies (fsdp2, sharded DiLoCo)
    fsdp_param = dist.fsdp.param_dtype if dist.fsdp else None
    if not computes_in_bf16_on_cpu(model, device, {amp, DTYPES.get(fsdp_param)}):
        return 0
    return use_layout_aware_linear(model)


def maybe_compile(model, t: TrainingConfig):
    """The module the loop runs forward on; weights stay shared with the uncompiled one."""
    if not t.torch_compile:
        return model
    return torch.compile(model, backend=t.torch_compile_backend, mode=t.torch_compile_mode,
                         dynamic=t.torch_compile_dynamic, fullgraph=t.torch_compile_fullgraph)


def compile_stats() -> dict[str, int]:
    """How many graphs dynamo captured (0 when nothing was compiled)."""
    from torch._dynamo.utils import counters

    return {"torch_compile_graphs": int(counters["stats"]["unique_graphs"])}
