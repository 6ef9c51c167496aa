"""Process-wide torch settings and model transforms chosen in `training`: determinism, matmul
precision, anomaly detection, the CUDA allocator, activation offloading, SDPA backends, gradient
checkpointing, bf16 CPU kernels (torch.compile is engine/modeling/compile.py).

Each is one call here so the loop reads as a recipe and tests can apply exactly what a training
run applies.
"""

from __future__ import annotations

import contextlib
import os

import torch

from engine.modeling.cpu_linear import (computes_in_bf16_on_cpu, native_bf16_gemm,
                                         use_layout_aware_linear)
from engine.modeling.model import DTYPES
from finetune.config.training import TrainingConfig
from finetune.errors import PipelineError


def autocast_dtype(t: TrainingConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `mixed_precision` (fp16 off CUDA is refused by the machine's
    rows of finetune/config/compat.py, before this runs)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.mixed_precision)


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
    if t.default_dtype:
        torch.set_default_dtype(DTYPES[t.default_dtype])
    if t.torch_compile:
        import torch._dynamo.config as dynamo
        import torch._functorch.config as functorch

        if t.dynamo_recompile_limit is not None:
            dynamo.recompile_limit = t.dynamo_recompile_limit
        if t.activation_memory_budget is not None:
            functorch.activation_memory_budget = t.activation_memory_budget


def apply_allocator_settings(t: TrainingConfig) -> None:
    """training.gc_threshold into PYTORCH_CUDA_ALLOC_CONF, before CUDA allocates anything
    (the allocator reads it once); other settings already there are kept."""
    if t.gc_threshold is None:
        return
    parts = [p for p in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
             if p and not p.startswith("garbage_collection_threshold:")]
    parts.append(f"garbage_collection_threshold:{t.gc_threshold}")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(parts)


def activation_offloading(t: TrainingConfig, device: torch.device):
    """The context a micro-batch's forward and backward run in: saved tensors to pinned host
    memory with enable_activation_offloading, else nothing."""
    if not t.enable_activation_offloading:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


#: on CUDA by default: never cuDNN while flash or memory-efficient attention can run, since
#: cuDNN plans every new sequence length on the host (~3 ms per call measured on an H100)
CUDA_SDPA = ("flash_attention", "efficient_attention", "cudnn_attention", "math")


@contextlib.contextmanager
def attention_backends(t: TrainingConfig, device: torch.device):
    """While open, SDPA may use only `t.sdpa_backend` (in that priority with
    `sdpa_set_priority`); the default is CUDA_SDPA on CUDA and torch's choice elsewhere."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = t.sdpa_backend  # kernels this device lacks: refused by finetune/config/compat.py
    if names is None and device.type != "cuda":
        yield
        return
    chosen = [getattr(SDPBackend, n.upper()) for n in (names or CUDA_SDPA)]
    with sdpa_kernel(chosen, set_priority=t.sdpa_set_priority if names else True):
        yield


def enable_gradient_checkpointing(model, t: TrainingConfig, log=None) -> None:
    """On the base model (before the adapter): HF's hook-based checkpointing per block, or
    the modules `enable_activation_checkpoint_fn` chooses."""
    if t.enable_activation_checkpoint_fn:
        chosen = checkpoint_chosen_modules(model, t)
        if log is not None:
            log(f"[train] activation checkpointing ({t.enable_activation_checkpoint_fn}): "
                f"{len(chosen)} modules recomputed in backward, e.g. {chosen[0]}")
        return
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


CHECKPOINT_FN = "training.enable_activation_checkpoint_fn"


def checkpoint_policy(ref: str):
    """The user's policy as `choose(module, name) -> bool`: a function of (module, name), or
    of the module alone (torch's `check_fn` of apply_activation_checkpointing)."""
    import inspect

    from finetune.imports import load_object

    fn = load_object(ref, CHECKPOINT_FN)
    try:
        arity = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C function: called with the module
        arity = 1
    return fn if arity >= 2 else (lambda module, name: fn(module))


def checkpoint_chosen_modules(model: torch.nn.Module, t: TrainingConfig) -> list[str]:
    """Recompute in backward the modules the policy returns True for (torch's composable
    checkpoint: hooks, so parameter names, the adapter's targets and checkpoints' keys stay as
    they are). Only the outermost of nested choices: an inner one would be recomputed twice.
    Returns their names; a policy that chooses nothing, or answers other than True/False, is
    one line."""
    from torch.distributed._composable import checkpoint

    ref = t.enable_activation_checkpoint_fn
    choose = checkpoint_policy(ref)
    chosen: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        answer = choose(module, name)
        if not isinstance(answer, bool):
            raise PipelineError(f"{CHECKPOINT_FN}: '{ref}' must return True or False; it "
                                f"returned {answer!r} for module '{name}'")
        if answer and not any(name.startswith(f"{outer}.") or not outer for outer, _ in chosen):
            chosen.append((name, module))
    if not chosen:
        raise PipelineError(f"{CHECKPOINT_FN}: '{ref}' chose none of the "
                            f"{type(model).__name__}'s modules; it is called with each "
                            "(module, name) and returns True for those to recompute")
    for _, module in chosen:
        checkpoint(module, preserve_rng_state=t.gradient_checkpointing_kwargs.preserve_rng_state)
    return [name or type(model).__name__ for name, _ in chosen]


def use_fast_bf16_cpu_kernels(model, device: torch.device, amp: torch.dtype | None,
                              param_dtype: torch.dtype | None,
                              native: bool | None = None) -> int:
    """bf16 on a CPU without native bf16 GEMMs: linear layers whose backward avoids the slow
    GEMM layout (see engine/modeling/cpu_linear.py); returns how many layers were switched (0:
    not a bf16 CPU run, or the CPU multiplies bf16 natively in any layout). `param_dtype`: what
    the strategy's mixed precision computes parameters in (Strategy.param_dtype; FSDP2 applies
    it only at the wrap, after this choice). `native`: cpu_linear.native_bf16_gemm() unless
    given."""
    if not computes_in_bf16_on_cpu(model, device, {amp, param_dtype}):
        return 0
    if native_bf16_gemm() if native is None else native:
        return 0
    return use_layout_aware_linear(model)
