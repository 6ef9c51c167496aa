"""GGUF encodings and file types (tasks/exporters/gguf/quants.py, kquants.py), in process.

The oracle for our k-quant bytes is the `gguf` package's own decoder (`gguf.quants.dequantize`,
written against llama.cpp's layout and independent of our encoder): a wrong byte layout decodes
to noise and fails the error bounds. The bounds, on the relative RMS error
sqrt(mean((decoded - x)^2) / mean(x^2)) of a seeded 64 x 1024 tensor:
- Gaussian: a plain grid over each sub-block's range (no scale search) measures 0.0783 (Q4_K),
  0.0383 (Q5_K), 0.0189 (Q6_K) on this tensor, about range/(2^bits - 1)/sqrt(12) of a 32-value
  Gaussian's range of ~4.1 sigma. Our search measures 0.0715, 0.0363, 0.0178; the bounds
  (0.075, 0.0375, 0.0184) sit between, so an encoder that loses its search fails.
- Student-t(3) (heavy tails): measured 0.0933, 0.0474, 0.0255; bounds about 5 % above.
- llama.cpp's own acceptance test (tests/test-quantize-fns.cpp) quantizes 0.1 + 2cos(i),
  i < 4096, and requires sqrt(sum(err^2))/n < 0.002 for every k-quant; we measure about
  0.00098, 0.00053, 0.00026 and hold the same bound.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize

from finetune.errors import PipelineError
from tasks.exporters.gguf import kquants
from tasks.exporters.gguf.quants import FILE_TYPES, check_block, encode, tensor_type

Q = GGMLQuantizationType
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
#: (Gaussian, Student-t(3)) relative RMS error bounds, justified in the module docstring
BOUNDS = {Q.Q4_K: (0.075, 0.098), Q.Q5_K: (0.0375, 0.050), Q.Q6_K: (0.0184, 0.0268)}


@pytest.fixture(scope="module")
def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"gaussian": rng.standard_normal((64, 1024)).astype(np.float32) * 0.02,
            "student-t3": rng.standard_t(3, (64, 1024)).astype(np.float32) * 0.02}


def round_trip(array: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    data = encode(array, qtype)
    return data, dequantize(data, qtype)


def rel_rms(decoded: np.ndarray, array: np.ndarray) -> float:
    return float(np.sqrt(np.mean((decoded - array) ** 2) / np.mean(array ** 2)))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quants_decode_with_gguf_within_error_bounds(qtype, tensors):
    block, type_size = GGML_QUANT_SIZES[qtype]
    for (kind, array), bound in zip(tensors.items(), BOUNDS[qtype]):
        data, decoded = round_trip(array, qtype)
        assert data.dtype == np.uint8 and data.shape == (64, 1024 // block * type_size)
        assert decoded.shape == array.shape and decoded.dtype == np.float32
        error = rel_rms(decoded, array)
        print(f"{qtype.name} {kind}: relative RMS error {error:.5f} (bound {bound})")
        assert error < bound, (qtype.name, kind, error)


def test_more_bits_less_error(tensors):
    """Each bit roughly halves the error: Q6_K < Q5_K < Q4_K, each at most 0.55 of the next."""
    for kind, array in tensors.items():
        q4, q5, q6 = (rel_rms(round_trip(array, q)[1], array) for q in K_TYPES)
        assert q6 < 0.55 * q5 and q5 < 0.55 * q4, (kind, q4, q5, q6)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quants_pass_llama_cpp_acceptance_bound(qtype):
    data = (0.1 + 2 * np.cos(np.arange(4096, dtype=np.float32))).astype(np.float32)
    decoded = round_trip(data[None], qtype)[1][0]
    error = float(np.sqrt(np.sum((decoded.astype(np.float64) - data) ** 2)) / data.size)
    print(f"{qtype.name} llama.cpp test-quantize-fns data: {error:.6f} (bound 0.002)")
    assert error < 0.002


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quants_of_degenerate_tensors(qtype):
    zeros = np.zeros((2, 512), np.float32)
    assert not encode(zeros, qtype).any()  # ggml's encoding of zeros: all bytes zero
    assert not round_trip(zeros, qtype)[1].any()
    # d is an f16 (rounding 5e-4); for 3e-3 it is an f16 subnormal (Q4_K: 3e-3/15/63, Q6_K:
    # 3e-3/32/128), good to a few per cent, as in llama.cpp
    for value, rtol in ((0.37, 1e-3), (-0.37, 1e-3), (3e-3, 0.05)):
        decoded = round_trip(np.full((2, 512), value, np.float32), qtype)[1]
        assert np.isfinite(decoded).all()
        np.testing.assert_allclose(decoded, value, rtol=rtol)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_an_outlier_changes_only_its_own_super_block(qtype, tensors):
    array = tensors["gaussian"][:8].copy()
    spiked = array.copy()
    spiked[3, 700] = 100.0  # 5000 standard deviations
    plain_bytes, spiked_bytes = encode(array, qtype), encode(spiked, qtype)
    decoded = dequantize(spiked_bytes, qtype)
    assert np.isfinite(decoded).all()
    assert abs(decoded[3, 700] - 100.0) < 0.5
    type_size = GGML_QUANT_SIZES[qtype][1]
    differs = (plain_bytes != spiked_bytes).reshape(8, 4, type_size).any(axis=2)
    assert differs.nonzero() == (np.array([3]), np.array([2]))  # row 3, super-block 700 // 256


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quants_are_deterministic_and_chunk_independent(qtype, tensors, monkeypatch):
    array = tensors["student-t3"]
    first = encode(array, qtype)
    assert np.array_equal(first, encode(array, qtype))
    monkeypatch.setattr(kquants, "CHUNK_BLOCKS", 3)  # chunks that cut rows mid-way
    assert np.array_equal(first, encode(array, qtype))


def test_encode_keeps_gguf_encoders_for_the_float_and_q8_types(tensors):
    array = tensors["gaussian"]
    assert encode(array, Q.F16).dtype == np.float16
    assert encode(array, Q.F32).dtype == np.float32
    assert rel_rms(dequantize(encode(array, Q.Q8_0), Q.Q8_0), array) < 0.01


def test_file_type_names_match_llama_cpp_names():
    for name, (file_type, _) in FILE_TYPES.items():
        assert file_type.name.endswith(name.upper()), name
    assert FILE_TYPES["q4_k_m"] == (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K)


def layer_types(file_type: str, kind: str, n_layers: int, qtype: GGMLQuantizationType) -> list[int]:
    return [i for i in range(n_layers)
            if tensor_type(file_type, f"blk.{i}.{kind}.weight", (512, 512), n_layers) == qtype]


@pytest.mark.parametrize("file_type", ["q4_k_m", "q5_k_m"])
def test_m_mixes_give_attn_v_and_ffn_down_q6_k_in_llama_cpp_layers(file_type):
    base = FILE_TYPES[file_type][1]
    for kind in ("attn_v", "ffn_down"):
        # llama.cpp's use_more_bits: first and last eighth, every third layer between
        assert layer_types(file_type, kind, 2, Q.Q6_K) == [1]
        assert layer_types(file_type, kind, 8, Q.Q6_K) == [0, 3, 6, 7]
        assert layer_types(file_type, kind, 24, Q.Q6_K) == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
        assert layer_types(file_type, kind, 8, base) == [1, 2, 4, 5]
    for kind in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert layer_types(file_type, kind, 8, base) == list(range(8))


def test_q4_k_s_gives_attn_v_its_first_four_layers_and_ffn_down_its_first_eighth_q5_k():
    assert layer_types("q4_k_s", "attn_v", 8, Q.Q5_K) == [0, 1, 2, 3]
    assert layer_types("q4_k_s", "ffn_down", 16, Q.Q5_K) == [0, 1]
    assert layer_types("q4_k_s", "ffn_up", 16, Q.Q4_K) == list(range(16))


@pytest.mark.parametrize("file_type", ["q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k"])
def test_output_gets_q6_k_token_embd_only_when_tied_norms_stay_f32(file_type):
    base = FILE_TYPES[file_type][1]
    shape = (32000, 1024)
    assert tensor_type(file_type, "output.weight", shape, 8) == Q.Q6_K
    assert tensor_type(file_type, "token_embd.weight", shape, 8) == base
    assert tensor_type(file_type, "token_embd.weight", shape, 8, tied_embeddings=True) == Q.Q6_K
    # rows that are not whole super-blocks: llama.cpp's output rule falls back to Q8_0
    assert tensor_type(file_type, "output.weight", (32000, 288), 8) == Q.Q8_0
    for norm in ("blk.0.attn_norm.weight", "blk.7.ffn_norm.weight", "output_norm.weight"):
        assert tensor_type(file_type, norm, (1024,), 8) == Q.F32


def test_float_and_q8_types_are_unchanged_by_the_mix():
    assert tensor_type("f16", "blk.0.attn_v.weight", (256, 256), 8) == Q.F16
    assert tensor_type("f16", "output.weight", (32000, 256), 8) == Q.F16
    assert tensor_type("q8_0", "output.weight", (32000, 256), 8) == Q.Q8_0
    assert tensor_type("q8_0", "blk.0.ffn_down.weight", (256, 1024), 8) == Q.Q8_0
    assert tensor_type("bf16", "blk.0.attn_norm.weight", (256,), 8) == Q.F32


def test_check_block_refuses_rows_that_are_not_whole_super_blocks():
    name, shape = "blk.0.ffn_up.weight", (688, 172)
    qtype = tensor_type("q4_k_m", name, shape, 2)
    with pytest.raises(PipelineError) as refused:
        check_block(name, shape, qtype, "q4_k_m")
    message = str(refused.value)
    assert "\n" not in message
    assert all(part in message for part in ("q4_k_m", name, "172", "Q4_K", "256")), message
    check_block(name, (688, 512), qtype, "q4_k_m")  # whole super-blocks pass
    with pytest.raises(ValueError, match="Q4_K needs rows of whole 256-value super-blocks"):
        encode(np.zeros(shape, np.float32), qtype)  # a writer that skipped the check
