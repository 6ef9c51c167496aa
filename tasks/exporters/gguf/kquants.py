"""llama.cpp's k-quants Q4_K, Q5_K and Q6_K, encoded in numpy over all of a tensor's blocks at once.

The `gguf` package decodes these types but cannot encode them, and llama.cpp's own quantizer is
C we don't ship. These encoders follow ggml's reference quantizers (`quantize_row_q4_K_ref`,
`_q5_K_ref`, `_q6_K_ref` in ggml-quants.c, the ones `llama-quantize` uses without an importance
matrix): the same super-block of 256 values, the same byte layout, and the same search for each
sub-block's scale (and min) over a fixed set of candidate scales. Here each candidate is one
array operation over every sub-block of a chunk of rows instead of a C loop per block. Sums run
in a different order than C's (and than C built with FMA), so a rare sub-block settles on a
neighbouring candidate: checked once against ggml's reference functions compiled from source,
98-99 % of super-blocks of Gaussian and heavy-tailed tensors came out byte-identical and the
error agreed to four digits. tests/test_gguf_quants.py decodes with `gguf.quants.dequantize`
and bounds the error.

Layout (little-endian, per super-block of 256 values):
- Q4_K (144 bytes): d, dmin (f16); 12 bytes of eight 6-bit scales and mins; 128 bytes of 4-bit q.
- Q5_K (176 bytes): as Q4_K, then 32 bytes of fifth bits (qh) before the 128 bytes of low nibbles.
- Q6_K (210 bytes): 128 bytes of low nibbles (ql), 64 bytes of high 2-bit pairs (qh), sixteen
  int8 scales, d (f16).
A value decodes as d*scale*q - dmin*min (Q4_K, Q5_K, q unsigned) or d*scale*(q - 32) (Q6_K).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
#: super-blocks encoded per pass: the temporaries (256 KB each) stay in cache, for any tensor size
CHUNK_BLOCKS = 256
#: ggml's GROUP_MAX_EPS: a group whose largest |value| is below this encodes as zeros
_GROUP_MAX_EPS = np.float32(1e-15)


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-group dot products of two (values, groups) arrays."""
    return np.einsum("ji,ji->i", a, b)


def _nearest(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round-half-even then clamp, in place, as ggml's nearest_int + MAX/MIN."""
    np.rint(v, out=v)
    return np.clip(v, lo, hi, out=v)


# The fits below take groups as columns, (values per group, groups): numpy then broadcasts a
# group's scale along contiguous memory and sums a group as whole-row adds, several times
# faster than one group per row.

def _fit_scale_min(xt: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Each group (column of `xt`) as scale*q - min with q in 0..nmax (ggml's
    make_qkx2_quants): start from the range (min(x, 0) .. max(x)) split in nmax steps, then try
    the grids of nmax + rmin + k*rdelta steps (k = 0..nstep) from the best min so far up to
    max(x), fit scale and min to each grid's q by weighted least squares, and keep whichever
    gives the smallest weighted squared error. Weights favour large values:
    sqrt(mean(x^2)) + |x|. Returns (scale, min), min >= 0."""
    n = xt.shape[0]
    w = np.sqrt(_dot(xt, xt) / n) + np.abs(xt)
    wx = w * xt
    # the per-group statistics are small: the fit and its error run in float64
    s_w, s_x, s_x2 = (a.astype(np.float64) for a in (w.sum(axis=0), wx.sum(axis=0), _dot(wx, xt)))
    top = xt.max(axis=0)
    lo = np.minimum(xt.min(axis=0), 0)
    flat = top <= lo
    top = np.where(flat, lo + 1, top)
    q, wq = np.empty_like(xt), np.empty_like(xt)

    def grid(steps: float, low: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # q = nearest((x - low) * steps / (max - low)), low the best min so far (as ggml does)
        np.subtract(xt, low, out=q)
        _nearest(np.multiply(q, np.float32(steps) / (top - low), out=q), 0, nmax)
        np.multiply(w, q, out=wq)
        return (wq.sum(axis=0).astype(np.float64), _dot(wq, q).astype(np.float64),
                _dot(wq, xt).astype(np.float64))

    # the start: the plain range split in nmax steps, its weighted squared error in full
    s_l, s_l2, s_xl = grid(nmax, lo)
    best_scale = (np.float32(1) / (np.float32(nmax) / (top - lo))).astype(np.float64)
    best_min = lo.astype(np.float64)
    best_err = (best_scale * (best_scale * s_l2 + 2 * (best_min * s_l - s_xl))
                + best_min * (best_min * s_w - 2 * s_x) + s_x2)
    # a least-squares fit's error is s_x2 - (scale*s_xl + min*s_x): compare that gain
    best_gain = s_x2 - best_err
    with np.errstate(divide="ignore", invalid="ignore"):
        for k in range(nstep + 1):
            s_l, s_l2, s_xl = grid(np.float32(rmin) + np.float32(rdelta) * k + nmax,
                                   best_min.astype(np.float32))
            det = s_w * s_l2 - s_l * s_l
            scale = (s_w * s_xl - s_x * s_l) / det
            mn = (s_l2 * s_x - s_l * s_xl) / det
            positive = mn > 0  # the min may only lower values: refit the scale alone
            np.copyto(scale, s_xl / s_l2, where=positive)
            np.copyto(mn, 0.0, where=positive)
            gain = scale * s_xl + mn * s_x
            better = (det > 0) & (gain > best_gain)
            np.copyto(best_gain, gain, where=better)
            np.copyto(best_scale, scale, where=better)
            np.copyto(best_min, mn, where=better)
    scale = np.where(flat, 0, best_scale).astype(np.float32)
    return scale, (-np.where(flat, lo, best_min)).astype(np.float32)


def _fit_symmetric(xt: np.ndarray, nmax: int) -> np.ndarray:
    """Each group (column of `xt`) as scale*q with q in -nmax..nmax-1 (ggml's make_qx_quants,
    weights x^2): the largest |value| maps to -nmax; of the grids of nmax + k/10 steps
    (k = -9..9) keep the one whose least-squares scale explains the most weighted energy."""
    absx = np.abs(xt)
    at = absx.argmax(axis=0)[None, :]
    peak = np.take_along_axis(xt, at, axis=0)[0]
    zero = np.take_along_axis(absx, at, axis=0)[0] < _GROUP_MAX_EPS
    peak = np.where(zero, np.float32(1), peak)
    w = xt * xt
    wx = w * xt
    q, wq = np.empty_like(xt), np.empty_like(xt)

    def grid(k: int) -> tuple[np.ndarray, np.ndarray]:
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(k)) / peak
        _nearest(np.multiply(xt, iscale, out=q), -nmax, nmax - 1)
        return (_dot(wx, q).astype(np.float64),
                _dot(np.multiply(w, q, out=wq), q).astype(np.float64))

    with np.errstate(divide="ignore", invalid="ignore"):
        s_lx, s_l2 = grid(0)
        best_scale = np.where(s_l2 > 0, s_lx / s_l2, 0)
        best = best_scale * s_lx  # the weighted energy the fit explains, sum_lx^2 / sum_l2
        for k in (*range(-9, 0), *range(1, 10)):
            s_lx, s_l2 = grid(k)
            better = (s_l2 > 0) & (s_lx * s_lx > best * s_l2)
            scale = s_lx / s_l2
            np.copyto(best_scale, scale, where=better)
            np.copyto(best, scale * s_lx, where=better)
    return np.where(zero, 0, best_scale).astype(np.float32)


def _pack_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins per super-block in 12 bytes: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins,
    bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    return np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
                           lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                           (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=1)


def _affine_blocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """The shared part of Q4_K and Q5_K over super-blocks `x` (N, 256): per 32-value sub-block a
    scale and min, both quantized to 6 bits against the super-block's largest (d, dmin in f16),
    then every value re-quantized against those stored numbers. Returns (d and dmin bytes,
    12 scale bytes, q as uint8 (N, 256))."""
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 8, 32).T)
    scales, mins = (a.reshape(n, 8) for a in _fit_scale_min(sub, nmax, rmin, rdelta, nstep))
    max_scale = np.maximum(scales.max(axis=1), 0)
    max_min = np.maximum(mins.max(axis=1), 0)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, np.float32(63) / max_scale, 0).astype(np.float32)
        inv_min = np.where(max_min > 0, np.float32(63) / max_min, 0).astype(np.float32)
    ls = _nearest(scales * inv_scale[:, None], 0, 63).astype(np.uint8)
    lm = _nearest(mins * inv_min[:, None], 0, 63).astype(np.uint8)
    d = (max_scale / np.float32(63)).astype(np.float16)
    dmin = (max_min / np.float32(63)).astype(np.float16)
    step = (d.astype(np.float32)[:, None] * ls).reshape(n * 8)
    offset = (dmin.astype(np.float32)[:, None] * lm).reshape(n * 8)
    live = step != 0
    q = (sub + offset) / np.where(live, step, 1)
    q = np.where(live, _nearest(q, 0, nmax), 0).astype(np.uint8).T.reshape(n, QK_K)
    head = np.stack([d, dmin], axis=1).view(np.uint8).reshape(n, 4)
    return head, _pack_scales_mins(ls, lm), q


def _low_nibbles_q4(q: np.ndarray) -> np.ndarray:
    """128 bytes per super-block: byte 32*c + i holds value 64*c + i (low nibble) and value
    64*c + 32 + i (high nibble), c = 0..3."""
    halves = (q & 0xF).reshape(-1, 4, 2, 32)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    head, scales, q = _affine_blocks(x, 15, -1.0, 0.1, 20)
    return np.concatenate([head, scales, _low_nibbles_q4(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    head, scales, q = _affine_blocks(x, 31, -0.5, 0.1, 15)
    # fifth bits: byte i, bit k holds value 32*k + i's bit 4
    high = (q >> 4).reshape(-1, 8, 32)
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([head, scales, qh.astype(np.uint8), _low_nibbles_q4(q)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)
    scales = _fit_symmetric(sub, 32).reshape(n, 16)
    at = np.abs(scales).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, at, axis=1)[:, 0]
    zero = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = np.float32(-128) / np.where(zero, np.float32(1), max_scale)
    d = (np.float32(1) / iscale).astype(np.float16)
    ls = _nearest(scales * iscale[:, None], -128, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * ls).reshape(n * 16)
    live = step != 0
    q = sub / np.where(live, step, 1)
    q = (np.where(live, _nearest(q, -32, 31), 0) + 32).astype(np.uint8).T.reshape(n, QK_K)
    # per half of 128 values, quarters a..d of 32: ql = [a | c<<4, b | d<<4], qh byte i holds
    # the top two bits of a[i], b[i], c[i], d[i] at bits 0, 2, 4, 6
    quarters = q.reshape(n, 2, 4, 32)
    low = quarters & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
                        axis=2).reshape(n, 128)
    high = (quarters >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(high, axis=2).astype(np.uint8).reshape(n, 64)
    out = np.concatenate([ql, qh, ls.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    out[zero] = 0  # ggml writes an all-zero block for a super-block of (near) zeros
    return out


ENCODERS = {GGMLQuantizationType.Q4_K: _q4_k, GGMLQuantizationType.Q5_K: _q5_k,
            GGMLQuantizationType.Q6_K: _q6_k}


def encode_k(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`array` (float32, last dimension a multiple of 256) as `qtype`'s bytes, shaped (..., rows'
    bytes) as gguf's own encoders return them."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    if qtype not in ENCODERS or array.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of whole {QK_K}-value super-blocks, not "
                         f"shape {array.shape} (quants.check_block says so in one line)")
    blocks = np.ascontiguousarray(array, dtype=np.float32).reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], type_size), dtype=np.uint8)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        out[start:start + CHUNK_BLOCKS] = ENCODERS[qtype](blocks[start:start + CHUNK_BLOCKS])
    return out.reshape(*array.shape[:-1], array.shape[-1] // QK_K * type_size)
