"""Can this model train on packed rows, and how? Measured, not assumed.

transformers builds a block-diagonal causal mask from position_ids that restart at 0 (its
packed-sequence detection; varlen kernels on flash attention), but only for models that use
its masking utilities. Rather than trusting a model list, the probe packs two short random
sequences into one row and compares the logits with two separate forwards: equal means the
model keeps packed examples apart. If position_ids alone are not enough, an explicit 4D
block-diagonal mask is tried; if that fails too, packing is refused with one line.
Padding-free training (one row per micro-batch, engine.datapath.attention) is probed the same way:
the model is switched to the varlen attention and must give the separate forwards' logits.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from engine.datapath.attention import choose_kernel, restore_attention, use_varlen_attention
from engine.datapath.data import collate, collate_flat, collate_packed, model_inputs, to_device
from engine.modeling.model import base_model
from finetune.errors import PipelineError

POSITION_IDS = "position_ids"
BLOCK_MASK = "block_mask"


def _max_diff(model, packed: dict, rows: list[dict], device, amp=None,
              alone=None) -> float:
    """Largest |packed - separate| logit difference over the examples, relative to each
    example's largest logit. `alone(row)`: the batch one example is fed as on its own (default:
    its plain ids)."""
    with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        out = model(**to_device(model_inputs(packed), device),
                    use_cache=False).logits[0].float()
        at, worst = 0, 0.0
        for r in rows:
            single = alone(r) if alone else {"input_ids": torch.tensor([r["input_ids"]])}
            single = model(**to_device(model_inputs(single), device), use_cache=False)
            single = single.logits[0].float()
            n = single.shape[0]
            scale = float(single.abs().max()) or 1.0
            worst = max(worst, float((out[at : at + n] - single).abs().max()) / scale)
            at += n
    return worst


def _tolerance(amp) -> float:
    """fp32 agrees to rounding; bf16/fp16 compute differs by GEMM shapes alone (~1e-2)."""
    return 1e-3 if amp is None else 3e-2


def _probe_rows(vocab_size: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, vocab_size, (n,), generator=g).tolist(),
             "labels": [0] * n} for n in (7, 5)]


def _takes_positions(model, key: str) -> None:
    forward = base_model(model).forward
    if POSITION_IDS not in inspect.signature(forward).parameters:
        raise PipelineError(
            f"{key}: {type(model).__name__}.forward takes no position_ids, so examples sharing "
            f"a row cannot restart their positions; set {key}: false"
        )


def enable_varlen(model, kernel: str, device: torch.device, amp=None, key: str =
                  "training.padding_free", capacity: int | None = None) -> None:
    """Switch `model` to the varlen attention with `kernel` (engine.datapath.attention) and check
    that a flattened micro-batch (or, with `capacity`, packed rows) gives the separate forwards'
    logits; else one line and no switch."""
    _takes_positions(model, key)
    before = use_varlen_attention(model, kernel)
    why = "its attention does not go through transformers' AttentionInterface"
    if before is not None:
        rows = _probe_rows(model.config.vocab_size)
        batch = (collate_flat(rows, 0) if capacity is None
                 else collate_packed(rows, 0, 12, varlen=True))
        was_training = model.training
        model.eval()
        try:
            alone = lambda r: collate_flat([r], 0)  # noqa: E731 (the same kernel, one example)
            if _max_diff(model, batch, rows, device, amp, alone) < _tolerance(amp):
                return
        finally:
            model.train(was_training)
        restore_attention(model, before)
        why = "its outputs for a flattened batch differ from separate forwards"
    raise PipelineError(
        f"{key}: {type(model).__name__} cannot train on varlen attention ({why}); set {key}: "
        "false (training.packing: true packs rows with a block mask instead)"
    )


def probe_packing(model, vocab_size: int, device: torch.device,
                  mask_dtype: torch.dtype = torch.float32) -> str:
    """POSITION_IDS or BLOCK_MASK: how packed rows must be fed to `model`."""
    _takes_positions(model, "training.packing")
    rows = _probe_rows(vocab_size)
    was_training = model.training
    model.eval()
    try:
        for mode, dtype in ((POSITION_IDS, None), (BLOCK_MASK, mask_dtype)):
            packed = collate_packed(rows, 0, 12, block_mask=dtype)
            if _max_diff(model, packed, rows, device) < 1e-3:
                return mode
    finally:
        model.train(was_training)
    raise PipelineError(
        f"training.packing: {type(model).__name__} lets packed examples attend to each other "
        "even with restarted position_ids and a block-diagonal mask; set training.packing: false"
    )


def prepare_batch_layout(t, max_seq_length: int, model, pad_id: int, device: torch.device,
                         amp: torch.dtype | None, log) -> Callable[[list[dict]], dict]:
    """The micro-batch layout `t` (the training section) asks for, made real: padded rows as
    they come; padding-free switches the model's attention to the varlen function with the
    kernel chosen for this machine and probes it; packing goes through the same varlen kernel
    where the machine has a real one (a GPU), else probes how the model keeps packed examples
    apart. Returns the collate function that feeds the model accordingly. `log`: a line for the
    run's log (the chosen kernel is always named)."""
    compute = amp or next(model.parameters()).dtype
    if t.padding_free:
        kernel = choose_kernel(device, compute, t.varlen_kernel)
        enable_varlen(model, kernel, device, amp)
        bucket = (f", padded to a multiple of {t.pad_to_multiple_of} tokens"
                  if t.pad_to_multiple_of else "")
        log(f"[train] padding-free: each micro-batch is one row{bucket}, attention kernel "
            f"{kernel}")
        return functools.partial(collate_flat, pad_id=pad_id, multiple=t.pad_to_multiple_of)
    if not t.packing:
        return functools.partial(collate, pad_id=pad_id, multiple=t.pad_to_multiple_of)
    capacity = t.packed_sequence_length or max_seq_length
    kernel = choose_kernel(device, compute, t.varlen_kernel)
    if kernel != "sdpa_per_example":
        enable_varlen(model, kernel, device, amp, "training.packing", capacity)
        log(f"[train] packing: rows of up to {capacity} tokens, examples kept apart by the "
            f"{kernel} varlen attention kernel")
        return functools.partial(collate_packed, pad_id=pad_id, capacity=capacity, varlen=True,
                                 multiple=t.pad_to_multiple_of)
    mode = probe_packing(model, model.config.vocab_size, device, compute)
    log(f"[train] packing: rows of up to {capacity} tokens, examples kept apart by "
        f"{'restarted position_ids' if mode == POSITION_IDS else 'a block mask'}")
    return functools.partial(collate_packed, pad_id=pad_id, capacity=capacity,
                             block_mask=None if mode == POSITION_IDS else compute,
                             multiple=t.pad_to_multiple_of)
