"""GGUF file types (export.gguf's names) and the per-tensor encodings they use.

A file type (`q4_k_m`) is a rule that picks each tensor's GGML type from its GGUF name and
layer; `encode` turns a float32 array into that type's bytes. f32/f16/bf16/q8_0 are the `gguf`
package's own encoders; the k-quants, which `gguf` only decodes, are ours (`kquants.py`, numpy,
whole tensors at once), checked against `gguf.quants.dequantize` in the tests. 1-D tensors
(norms) stay f32 in every type, as llama.cpp keeps them.

The k-quant mixes follow llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) for the
Llama family, so a file we write holds the same types `llama-quantize` would give it:
- output.weight gets Q6_K (Q8_0 when its rows are not whole super-blocks of 256); a model with
  tied embeddings has no output.weight, and then token_embd.weight takes that rule instead;
- `_m` types give attn_v and ffn_down Q6_K in the layers `_more_bits` picks (the first and
  last eighth, and every third layer between); q4_k_s gives them Q5_K in its first layers;
- everything else 2-D is the file type's base type.
Not carried over: llama.cpp's rules for other architectures (Falcon, 70B-size GQA, MoE experts)
and its silent fallback to a 32-block type for rows that are not multiples of 256 (we refuse
in one line instead: `check_block`).
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf import quants as gguf_quants

from finetune.errors import PipelineError
from tasks.exporters.gguf.kquants import ENCODERS as K_ENCODERS
from tasks.exporters.gguf.kquants import encode_k

Q = GGMLQuantizationType

#: export.gguf's names -> (the file's general.file_type, the GGML type of its 2-D tensors)
FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "f32": (LlamaFileType.ALL_F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
    "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K),
    "q5_k_s": (LlamaFileType.MOSTLY_Q5_K_S, Q.Q5_K),
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
    "q4_k_s": (LlamaFileType.MOSTLY_Q4_K_S, Q.Q4_K),
}


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third
    layer in between, are the ones whose attn_v and ffn_down hurt most when squeezed."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


#: file type -> {tensor kind: (promoted type, which layers (layer, n_layers) get it)}
_PROMOTIONS: dict[str, dict[str, tuple[GGMLQuantizationType, Callable[[int, int], bool]]]] = {
    "q4_k_m": {"attn_v": (Q.Q6_K, _more_bits), "ffn_down": (Q.Q6_K, _more_bits)},
    "q5_k_m": {"attn_v": (Q.Q6_K, _more_bits), "ffn_down": (Q.Q6_K, _more_bits)},
    "q4_k_s": {"attn_v": (Q.Q5_K, lambda layer, n: layer < 4),
               "ffn_down": (Q.Q5_K, lambda layer, n: layer < n // 8)},
}
_LAYER_KIND = re.compile(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$")


def tensor_type(file_type: str, name: str, shape: tuple[int, ...], n_layers: int, *,
                tied_embeddings: bool = False) -> GGMLQuantizationType:
    """The GGML type tensor `name` (its GGUF name, e.g. `blk.3.ffn_down.weight`; `shape` as
    torch has it, rows first) gets in a `file_type` file of `n_layers` blocks.
    `tied_embeddings`: the model has no output.weight, its token_embd.weight is also the
    output projection (and is quantized as one)."""
    base = FILE_TYPES[file_type][1]
    if len(shape) < 2:
        return Q.F32
    if base in (Q.F32, Q.F16, Q.BF16):
        return base
    if not name.endswith(".weight") or name.endswith("_norm.weight"):
        return Q.F32  # llama.cpp quantizes only weights, never norms
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        if shape[-1] % GGML_QUANT_SIZES[base][0]:
            return Q.Q8_0
        return base if base == Q.Q8_0 else Q.Q6_K
    if (found := _LAYER_KIND.search(name)) and found[2] in _PROMOTIONS.get(file_type, {}):
        promoted, picks = _PROMOTIONS[file_type][found[2]]
        if picks(int(found[1]), n_layers):
            return promoted
    return base


def check_block(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                file_type: str) -> None:
    """One line when a row of `name` is not a whole number of `qtype`'s blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        raise PipelineError(
            f"export.gguf: {file_type} cannot encode {name}: its rows of {shape[-1]} are not a "
            f"multiple of {qtype.name}'s block of {block}; list f32, f16 or bf16 for this model")


def encode(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`array` (float32, rows last-dim contiguous) as `qtype`'s bytes (uint8 for block types,
    the float dtype for f32/f16), shaped as `gguf.GGUFWriter.add_tensor(raw_dtype=qtype)`
    takes it."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype in K_ENCODERS:
        return encode_k(array, qtype)
    return gguf_quants.quantize(array, qtype)
