"""Padding-free attention: one row per micro-batch, attention computed per example.

Padded batches spend compute on pad slots (a third of it on Alpaca at batch 8) and packed rows
of fixed width still pad the last row and run attention over the whole row behind a
block-diagonal mask, which on CPU takes SDPA's slow masked path. Flattening the micro-batch
into one row removes the padding entirely, and running SDPA once per example (causal, no mask:
the fast kernel) keeps examples apart and makes attention cost the sum of the squares of the
example lengths instead of the square of the row.

The boundaries travel as `cu_seq_lens_q`/`cu_seq_lens_k` (cumulative lengths, transformers'
varlen keyword names, which its models pass from `forward(**kwargs)` down to the attention
function) and stay on the host (engine.data.HOST_KEYS), so slicing needs no device sync. Registered with transformers'
AttentionInterface under VARLEN_SDPA; any batch without boundaries (padded evaluation,
generation) falls through to the stock SDPA function with the stock SDPA mask, so the model
stays usable for everything else while it is switched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from engine.model import base_model

VARLEN_SDPA = "finetune_varlen_sdpa"


def varlen_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs):
    """(batch 1, heads, tokens, dim) -> (1, tokens, heads, dim), attention per example."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_SDPA}: cu_seq_lens need a batch of one row, got "
                         f"{query.shape[0]}")
    bounds = cu.tolist()
    gqa = query.shape[1] != key.shape[1]
    outs = [F.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, is_causal=True,
        scale=scaling, enable_gqa=gqa) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, sdpa_mask)


def use_varlen_attention(model) -> str | None:
    """Switch a transformers model (or a PEFT model around one) to VARLEN_SDPA; returns the
    implementation it had (to switch back), or None when it cannot be switched."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if not hasattr(base, "set_attn_implementation") or config is None:
        return None
    if not getattr(base, "_can_set_attn_implementation", lambda: False)():
        return None
    before = config._attn_implementation
    base.set_attn_implementation(VARLEN_SDPA)
    return before if config._attn_implementation == VARLEN_SDPA else None


def restore_attention(model, implementation: str) -> None:
    base_model(model).set_attn_implementation(implementation)
