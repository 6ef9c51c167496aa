"""GGUF file types (export.gguf's names) and the per-tensor encodings they use.

A file type (`q4_k_m`) is a rule that picks each tensor's GGML type from its GGUF name and
layer; `encode` turns a float32 array into that type's bytes. f32/f16/bf16/q8_0 are the `gguf`
package's own encoders; the k-quants, which `gguf` only decodes, are ours (numpy, whole
tensors at once), checked against `gguf.quants.dequantize` in the tests. 1-D tensors (norms)
stay f32 in every type, as llama.cpp keeps them.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf import quants as gguf_quants

from finetune.errors import PipelineError

Q = GGMLQuantizationType

#: export.gguf's names -> (the file's general.file_type, the GGML type of its 2-D tensors)
FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "f32": (LlamaFileType.ALL_F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
}


def tensor_type(file_type: str, name: str, shape: tuple[int, ...], n_layers: int
                ) -> GGMLQuantizationType:
    """The GGML type tensor `name` (its GGUF name, e.g. `blk.3.ffn_down.weight`; `shape` as
    torch has it, rows first) gets in a `file_type` file of `n_layers` blocks."""
    if len(shape) < 2:
        return Q.F32
    return FILE_TYPES[file_type][1]


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
    return gguf_quants.quantize(array, qtype)
