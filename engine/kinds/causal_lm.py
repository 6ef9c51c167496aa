"""A decoder-only language model (transformers' AutoModelForCausalLM): the default kind, whose
answers are engine.kinds.base.ModelKind's own (next-token labels, the full or chunked loss, the
configured batch layout)."""

from __future__ import annotations

from engine.kinds.base import ModelKind


class CausalLM(ModelKind):
    name = "causal_lm"
