"""What a GGUF file of one architecture family looks like, in one table.

llama.cpp names tensors its own way (`blk.3.attn_q.weight`), stores the attention heads' rows of
q and k in the interleaved order its rope kernel wants (transformers keeps them rotate-half), and
reads the hyper-parameters from `<arch>.*` keys. A `Family` holds those three differences for one
architecture; the model writer and the LoRA writer both go through it, so a new family is one
more entry in `FAMILIES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, RopeScalingType

from finetune.errors import PipelineError

T = MODEL_TENSOR

#: the whole-model tensors, by their transformers state-dict name (suffix `.weight`/`.bias` aside)
_GLOBAL = {
    "model.embed_tokens": T.TOKEN_EMBD,
    "model.norm": T.OUTPUT_NORM,
    "lm_head": T.OUTPUT,
}

#: one decoder layer's tensors, by their name under `model.layers.<i>.`
_LLAMA_BLOCK = {
    "input_layernorm": T.ATTN_NORM,
    "self_attn.q_proj": T.ATTN_Q,
    "self_attn.k_proj": T.ATTN_K,
    "self_attn.v_proj": T.ATTN_V,
    "self_attn.o_proj": T.ATTN_OUT,
    "post_attention_layernorm": T.FFN_NORM,
    "mlp.gate_proj": T.FFN_GATE,
    "mlp.up_proj": T.FFN_UP,
    "mlp.down_proj": T.FFN_DOWN,
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_WHOLE = re.compile(r"^(.+)\.(weight|bias)$")

#: rope types llama.cpp's llama graph computes from keys alone (llama3's needs a rope_freqs
#: tensor, yarn/longrope more keys than transformers' loader reads back)
_ROPE_TYPES = ("default", "linear")


@dataclass(frozen=True)
class Family:
    """One architecture's GGUF layout: `arch` is general.architecture, the prefix of its keys."""

    arch: str
    hf_architectures: tuple[str, ...]
    block: dict = field(hash=False)  # module under model.layers.<i>. -> MODEL_TENSOR

    def gguf_name(self, hf_name: str) -> str | None:
        """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`; None for a name
        llama.cpp has no tensor for (rotary inv_freq, anything unknown): the caller decides
        whether that is an error."""
        if match := _LAYER.match(hf_name):
            layer, module, kind = match.groups()
            tensor = self.block.get(module)
            return None if tensor is None else f"{TENSOR_NAMES[tensor].format(bid=layer)}.{kind}"
        if match := _WHOLE.match(hf_name):
            module, kind = match.groups()
            tensor = _GLOBAL.get(module)
            return None if tensor is None else f"{TENSOR_NAMES[tensor]}.{kind}"
        return None

    def permute_rows(self, gguf_name: str, rows: np.ndarray, hf_config) -> np.ndarray:
        """`rows` (output rows first: a weight, a bias, or a LoRA B of out x r) in llama.cpp's
        order. Within each head, transformers keeps the rotary pairs as (first half, second
        half); llama.cpp's rope rotates adjacent rows, so row i of the first half and row i of the
        second half become rows 2i and 2i+1. Only attn_q (per query head) and attn_k (per kv
        head) change; every other tensor comes back as it is."""
        if ".attn_q." in gguf_name:
            heads = hf_config.num_attention_heads
        elif ".attn_k." in gguf_name:
            heads = _kv_heads(hf_config)
        else:
            return rows
        n_rows = rows.shape[0]
        if n_rows % (2 * heads):
            raise PipelineError(
                f"export.gguf: {gguf_name} has {n_rows} rows, not a whole number of "
                f"{heads} heads of rotary pairs; the model's config does not match its weights")
        half = n_rows // heads // 2
        return (rows.reshape(heads, 2, half, *rows.shape[1:])
                .swapaxes(1, 2)
                .reshape(rows.shape))

    def write_hparams(self, writer, hf_config) -> None:
        """The `<arch>.*` keys llama.cpp builds the graph from (and transformers' GGUF loader
        turns back into a config)."""
        c = hf_config
        head_dim = _head_dim(c)
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_block_count(c.num_hidden_layers)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(_kv_heads(c))
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_rope_dimension_count(head_dim)
        if head_dim != c.hidden_size // c.num_attention_heads:  # llama.cpp's default otherwise
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_vocab_size(c.vocab_size)
        rope = _rope(c)
        writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
        if rope.get("rope_type", "default") == "linear":
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))

    def check(self, hf_config) -> None:
        """One line for a config this family's llama.cpp graph would compute differently."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise PipelineError(
                f"export.gguf: hidden_act {act!r} cannot be written as GGUF; llama.cpp's "
                f"{self.arch} uses silu")
        rope_type = _rope(hf_config).get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise PipelineError(
                f"export.gguf: rope_type {rope_type!r} (the model's rope_parameters) cannot be "
                f"written as GGUF yet; supported: {', '.join(_ROPE_TYPES)}")


def _kv_heads(c) -> int:
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _rope(c) -> dict:
    """The rope settings, as transformers 5 (`rope_parameters`) or 4 (`rope_theta`,
    `rope_scaling`) spells them."""
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    if "rope_theta" not in rope and getattr(c, "rope_theta", None) is not None:
        rope["rope_theta"] = c.rope_theta
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


LLAMA = Family(arch=MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA],
               hf_architectures=("LlamaForCausalLM",), block=_LLAMA_BLOCK)

#: transformers model_type -> Family
FAMILIES = {"llama": LLAMA}


def family_for(hf_config) -> Family:
    """The Family of a transformers config, after checking llama.cpp can run it as it is; one
    line naming the architecture for anything else."""
    family = FAMILIES.get(getattr(hf_config, "model_type", None))
    architectures = getattr(hf_config, "architectures", None) or []
    arch = architectures[0] if architectures else getattr(hf_config, "model_type", "this model")
    if family is None or (architectures and arch not in family.hf_architectures):
        supported = ", ".join(a for f in FAMILIES.values() for a in f.hf_architectures)
        raise PipelineError(
            f"export.gguf: {arch} cannot be written as GGUF yet; supported: {supported}")
    family.check(hf_config)
    return family
