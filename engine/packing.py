"""Can this model train on packed rows, and how? Measured, not assumed.

transformers builds a block-diagonal causal mask from position_ids that restart at 0 (its
packed-sequence detection; varlen kernels on flash attention), but only for models that use
its masking utilities. Rather than trusting a model list, the probe packs two short random
sequences into one row and compares the logits with two separate forwards: equal means the
model keeps packed examples apart. If position_ids alone are not enough, an explicit 4D
block-diagonal mask is tried; if that fails too, packing is refused with one line.
Padding-free training (one row per micro-batch, engine.attention) is probed the same way: the
model is switched to the varlen attention and must give the separate forwards' logits.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from engine.attention import restore_attention, use_varlen_attention
from engine.data import collate, collate_flat, collate_packed, model_inputs, to_device
from engine.model import base_model
from finetune.errors import PipelineError

POSITION_IDS = "position_ids"
BLOCK_MASK = "block_mask"


def _max_diff(model, packed: dict, rows: list[dict], device) -> float:
    with torch.no_grad():
        out = model(**to_device(model_inputs(packed), device),
                    use_cache=False).logits[0]
        at, worst = 0, 0.0
        for r in rows:
            ids = torch.tensor([r["input_ids"]], device=device)
            alone = model(input_ids=ids, use_cache=False).logits[0]
            n = ids.shape[1]
            scale = float(alone.abs().max()) or 1.0
            worst = max(worst, float((out[at : at + n] - alone).abs().max()) / scale)
            at += n
    return worst


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


def enable_padding_free(model, vocab_size: int, device: torch.device) -> None:
    """Switch `model` to per-example varlen attention (engine.attention) and check that a
    flattened micro-batch gives the separate forwards' logits; else one line and no switch."""
    _takes_positions(model, "training.padding_free")
    before = use_varlen_attention(model)
    why = "its attention does not go through transformers' AttentionInterface"
    if before is not None:
        rows = _probe_rows(vocab_size)
        was_training = model.training
        model.eval()
        try:
            if _max_diff(model, collate_flat(rows, 0), rows, device) < 1e-3:
                return
        finally:
            model.train(was_training)
        restore_attention(model, before)
        why = "its outputs for a flattened batch differ from separate forwards"
    raise PipelineError(
        f"training.padding_free: {type(model).__name__} cannot train padding-free ({why}); "
        "set training.padding_free: false (training.packing: true packs rows with a block "
        "mask instead)"
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
    they come; padding-free switches the model's attention to the varlen function and probes
    it; packing probes how the model keeps packed examples apart. Returns the collate function
    that feeds the model the way the probe found it needs. `log`: a line for the run's log."""
    if t.padding_free:
        enable_padding_free(model, model.config.vocab_size, device)
        log("[train] padding-free: each micro-batch is one row, attention per example")
        return functools.partial(collate_flat, pad_id=pad_id)
    if not t.packing:
        return functools.partial(collate, pad_id=pad_id)
    mask_dtype = amp or next(model.parameters()).dtype
    mode = probe_packing(model, model.config.vocab_size, device, mask_dtype)
    capacity = t.packed_sequence_length or max_seq_length
    log(f"[train] packing: rows of up to {capacity} tokens, examples kept apart by "
        f"{'restarted position_ids' if mode == POSITION_IDS else 'a block mask'}")
    return functools.partial(collate_packed, pad_id=pad_id, capacity=capacity,
                             block_mask=None if mode == POSITION_IDS else mask_dtype)
