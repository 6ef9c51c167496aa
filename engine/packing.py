"""Can this model train on packed rows, and how? Measured, not assumed.

transformers builds a block-diagonal causal mask from position_ids that restart at 0 (its
packed-sequence detection; varlen kernels on flash attention), but only for models that use
its masking utilities. Rather than trusting a model list, the probe packs two short random
sequences into one row and compares the logits with two separate forwards: equal means the
model keeps packed examples apart. If position_ids alone are not enough, an explicit 4D
block-diagonal mask is tried; if that fails too, packing is refused with one line.
"""

from __future__ import annotations

import inspect

import torch

from engine.data import collate_packed, model_inputs
from finetune.errors import PipelineError

POSITION_IDS = "position_ids"
BLOCK_MASK = "block_mask"


def _max_diff(model, packed: dict, rows: list[dict], device) -> float:
    with torch.no_grad():
        out = model(**{k: v.to(device) for k, v in model_inputs(packed).items()},
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


def probe_packing(model, vocab_size: int, device: torch.device,
                  mask_dtype: torch.dtype = torch.float32) -> str:
    """POSITION_IDS or BLOCK_MASK: how packed rows must be fed to `model`."""
    forward = getattr(model, "get_base_model", lambda: model)().forward
    if POSITION_IDS not in inspect.signature(forward).parameters:
        raise PipelineError(
            f"training.packing: {type(model).__name__}.forward takes no position_ids, so packed "
            "examples cannot restart their positions; set training.packing: false"
        )
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, vocab_size, (n,), generator=g).tolist(),
             "labels": [0] * n} for n in (7, 5)]
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
