"""The chunked loss (training.loss_chunk_tokens, the default) against the full-logits loss, on
this machine: our train stage, same model, data, steps and order, each layout run with both,
alternating, `--repeats` times. Prints useful tokens/s and peak RSS of each and the ratio.

    .venv/bin/python bench/loss_chunks.py [--model llama-4M] [--steps 30] [--repeats 2]

Alpaca from ../shared (by path), the suite's models (bench/throughput.py). Writes
bench/results/loss-chunks-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from throughput import MODELS, build_model, prepare_data, run_ours
from workdir import ROOT, copy_project, machine, markdown_table, set_params

CHUNKS = {"full logits": None, "chunked 4096": 4096}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-4M", choices=list(MODELS))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layouts", default="padded,padfree")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-loss-") as tmp:
        project = copy_project(Path(tmp) / "p")
        model_dir = build_model(args.model, Path(tmp) / "model")
        prepare_data(project, "alpaca", 512)
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.repeats):
            for layout in args.layouts.split(","):
                for name, chunk in CHUNKS.items():
                    set_params(project, {"training.loss_chunk_tokens": chunk})
                    runs.setdefault((layout, name), []).append(
                        run_ours(project, model_dir, args.precision, args.steps, layout))
    rows = []
    for (layout, name), results in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in results)
        base = statistics.median(r["tokens_per_s"] for r in runs[(layout, "full logits")])
        rows.append({"layout": layout, "loss": name, "tok_s": round(tps, 1),
                     "vs_full": round(tps / base, 3),
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
                     "final_loss": results[0]["final_loss"]})
    where = machine()
    print(f"{args.model}, {args.precision}, Alpaca, {args.steps} steps, median of "
          f"{args.repeats}; {where}\n")
    print(markdown_table(rows, list(rows[0])))
    out = ROOT / "bench/results" / f"loss-chunks-{args.model}-{args.precision}-cpu.json"
    out.write_text(json.dumps({"machine": where, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
