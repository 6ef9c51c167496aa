"""The model a training run steps: every transform between the stored weights and the
module the loop runs forward on, in one order (the recipe's `setup` calls `build_model`).

Order, and why:
1. load (model.dtype; training.construct_model_on: on the CPU, straight onto the device, or
   as a weightless skeleton);
2. gradient checkpointing: HF's hooks (or those on the modules enable_activation_checkpoint_fn
   chooses) go on the base model, before the adapter wraps it;
3. PEFT, then QAT's fake-quantised layers around the frozen ones (inside the adapters);
4. the strategy keeps this rank's part (pipeline: its stages) and places it (`Strategy.place`):
   on the device, or read from the checkpoint when built on meta;
5. fp8 conversion, bf16 CPU kernels, the batch layout (attention switch and probe);
6. the loss (probed against the full loss before wrapping), the strategy's wrap
   (DDP/FSDP2/DiLoCo/pipeline), torch.compile of the wrapped module.
Built on meta under FSDP2, the model is sharded before any weight exists and each rank reads
its shards after the wrap (the placement's `after_wrap`); the batch-layout and loss probes wait
for that read and run on the sharded model (every rank the same probe batch: its forward is
collective). Which of the two happens is the strategy's placement, not a branch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engine.datapath.packing import prepare_batch_layout
from engine.modeling.adapter import apply_peft
from engine.modeling.compile import maybe_compile
from engine.modeling.fused_lora import use_fused_lora
from engine.kinds import kind_of
from engine.modeling.model import count_parameters, load_base_model, resolve_model_ref
from engine.modeling.quantization import convert_to_fp8, prepare_qat
from engine.modeling.runtime import enable_gradient_checkpointing, use_fast_bf16_cpu_kernels
from engine.strategies import build_strategy
from engine.strategies.base import StoredWeights, Strategy
from finetune.config import FinetuneConfig
from finetune.imports import load_object


@dataclass
class BuiltModel:
    model: torch.nn.Module  # what the loop runs forward on (wrapped, maybe compiled)
    strategy: Strategy
    loss: Any  # engine.objective.loss's; None when the strategy computes its own (pipeline)
    collate_fn: Callable[[list[dict]], dict]
    trainable: int  # parameters of the whole model, before any rank keeps its part
    total: int
    construction: dict[str, Any] = field(default_factory=dict)  # what meta read
    #: how evaluation batches are built (the model kind's: engine.kinds)
    eval_collate: Callable[[list[dict]], dict] | None = None


def build_model(cfg: FinetuneConfig, root: Path, d, meter, labels: list[str] | None,
                pad_id: int, amp: torch.dtype | None, log: Callable[[str], None]) -> BuiltModel:
    t, kind = cfg.training, kind_of(cfg)
    base = load_base_model(cfg.model, root, labels=labels, construct=t.construct_model_on,
                           device=d.device, log=log)
    enable_gradient_checkpointing(base, t, log)
    model = apply_peft(base, kind.prepare_base(base, cfg), t.seed)
    if t.qat_recipe:  # around the frozen layers, inside the adapters
        prepare_qat(model, t.qat_recipe, t.qat_group_size, log)
    trainable, total = count_parameters(model)
    strategy = build_strategy(cfg, d, meter)
    model = strategy.keep_own_part(model)
    stored = (StoredWeights(resolve_model_ref(cfg.model.name_or_path, root), cfg.model.revision)
              if t.construct_model_on == "meta" else None)
    placement = strategy.place(model, stored)
    model = placement.model
    if t.fp8_recipe:
        convert_to_fp8(model, t.fp8_recipe, t.fp8_dim_alignment, d.device, log)
    fast_linears = use_fast_bf16_cpu_kernels(model, d.device, amp, strategy.param_dtype)
    if fast_linears:
        log(f"[train] bf16 on CPU: {fast_linears} linear layers use layout-aware GEMMs")
    if t.fused_lora and (fused := use_fused_lora(model)):
        log(f"[train] fused LoRA: {fused} adapted linear layers (where plain LoRA; see "
            "training.fused_lora)")
    # before the wrap, or (sharded on meta) once the wrap's shards are read
    layout_and_loss = placement.when_weights_exist(
        lambda: _layout_and_loss(cfg, kind, model, strategy, pad_id, d, amp, log))
    wrapped = strategy.wrap(model)
    construction = placement.after_wrap()
    collate_fn, loss = layout_and_loss()
    if stored is not None:
        log(f"[train] construct_model_on meta: read {construction['construct_tensors_read']} "
            f"stored tensors ({construction['construct_bytes_read'] / 2**20:.2f} MiB) on this "
            "rank")
    return BuiltModel(maybe_compile(wrapped, t), strategy, loss, collate_fn, trainable, total,
                      construction, kind.eval_collate(cfg, model, pad_id))


def _layout_and_loss(cfg: FinetuneConfig, kind, model, strategy: Strategy, pad_id: int, d,
                     amp, log):
    """The collate function (batch layout, maybe probed) and the loss (probed against the
    full loss), both on the model as it now is."""
    t = cfg.training
    collate_fn = prepare_batch_layout(t, cfg.data.max_seq_length, model, pad_id, d.device,
                                      amp, log)
    # a named collator, an encoder-decoder's own layout (compat: no other): the kind's
    collate_fn = kind.train_collate(cfg, model, pad_id, collate_fn)
    loss = None
    if t.use_liger_kernel:  # the pipeline and user losses are refused with it (compat)
        from engine.objective.liger import apply_liger

        loss = apply_liger(model, d.device, amp, log)
    elif t.fused_loss_factory:  # likewise refused with a user loss and the pipeline
        from engine.objective.fused import factory_loss

        loss = strategy.make_loss(
            lambda: factory_loss(model, t.fused_loss_factory, d.device, amp, log))
    else:
        user_fn = (load_object(t.compute_loss_func, "training.compute_loss_func")
                   if t.compute_loss_func else None)
        loss = strategy.make_loss(lambda: kind.loss(model, cfg, d.device, amp, user_fn))
    return collate_fn, loss
