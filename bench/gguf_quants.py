"""GGUF encoding speed on this CPU: our numpy k-quants (Q4_K, Q5_K, Q6_K) and gguf's Q8_0 against
gguf's f16 conversion (the baseline, measured in the same run), on the tensors of one layer of a
0.4B-class Llama (hidden 1024, FFN 4096, 32000-token vocabulary, 24 layers), extrapolated to the
whole model for each export.gguf file type.

    .venv/bin/python bench/gguf_quants.py [--layers 1] [--repeats 3] [--quick]

Seeded Gaussian weights (std 0.02, the usual init scale), float32 in; MB/s counts float32 input
bytes. Each type's time is the best of --repeats. --quick: one repeat over half a layer, well
under a minute. The whole-model estimate sums, over every 2-D tensor of the 24-layer model, its
size over the measured speed of the type the file type's mix gives it (1-D norms are copied,
not counted). Writes bench/results/gguf-quants-cpu.json (--quick: gguf-quants-quick-cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from workdir import ROOT, machine, markdown_table

from tasks.exporters.gguf.quants import FILE_TYPES, encode, tensor_type

Q = GGMLQuantizationType
HIDDEN, FFN, VOCAB, LAYERS = 1024, 4096, 32000, 24
#: one layer's 2-D tensors, GGUF name -> torch shape (rows, columns)
LAYER = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN, HIDDEN), "attn_v": (HIDDEN, HIDDEN),
         "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
         "ffn_down": (HIDDEN, FFN)}
TYPES = [Q.F16, Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K]


def model_tensors() -> dict[str, tuple[int, int]]:
    """The whole model's 2-D tensors (untied embeddings)."""
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.{kind}.weight": shape for kind, shape in LAYER.items()})
    return shapes


def timed(arrays: list[np.ndarray], qtype: GGMLQuantizationType, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for array in arrays:
            encode(array, qtype)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=float, default=1.0, help="layers' worth of tensors to time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat over half a layer")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.repeats = 0.5, 1
    rng = np.random.default_rng(0)
    arrays = []
    for rows, cols in LAYER.values():
        n_rows = max(1, round(rows * args.layers))
        arrays.append((rng.standard_normal((n_rows, cols)) * 0.02).astype(np.float32))
    megabytes = sum(a.nbytes for a in arrays) / 1e6
    speed, rows = {}, []
    for qtype in TYPES:
        seconds = timed(arrays, qtype, args.repeats)
        speed[qtype] = megabytes / seconds
        sample = arrays[-1][:64]
        decoded = dequantize(encode(sample, qtype), qtype).astype(np.float32)
        error = float(np.sqrt(np.mean((decoded - sample) ** 2) / np.mean(sample ** 2)))
        rows.append({"type": qtype.name, "seconds": round(seconds, 3),
                     "MB_per_s": int(round(speed[qtype])),
                     "speed_vs_f16": round(speed[qtype] / speed[Q.F16], 4),
                     "rel_rms_error": round(error, 5)})
    shapes = model_tensors()
    estimates = []
    for name in FILE_TYPES:
        if name in ("f32", "bf16"):
            continue
        seconds = 0.0
        for tensor, shape in shapes.items():
            qtype = tensor_type(name, tensor, shape, LAYERS)
            seconds += shape[0] * shape[1] * 4 / 1e6 / speed[qtype]
        estimates.append({"file_type": name, "est_seconds_whole_model": int(round(seconds))})
    where = {**machine(), "load_average": os.getloadavg()}
    print(f"{megabytes:.0f} MB of float32 ({args.layers} layer(s) of a hidden-{HIDDEN} / "
          f"FFN-{FFN} Llama), best of {args.repeats}; {where}\n")
    print(markdown_table(rows, list(rows[0])))
    n_params = sum(r * c for r, c in shapes.values())
    print(f"\nWhole model ({LAYERS} layers, {n_params / 1e6:.0f}M parameters in 2-D tensors), "
          "estimated from the speeds above:\n")
    print(markdown_table(estimates, list(estimates[0])))
    out = ROOT / "bench/results" / f"gguf-quants{'-quick' if args.quick else ''}-cpu.json"
    out.write_text(json.dumps({"machine": where, "args": vars(args), "rows": rows,
                               "whole_model": estimates}, indent=2))


if __name__ == "__main__":
    main()
