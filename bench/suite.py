"""The benchmark suite, one command (README "Benchmarks"):

    .venv/bin/python bench/suite.py            # everything, ~35 min on 2 cores
    .venv/bin/python bench/suite.py --quick    # smoke run of every section, ~4 min on 2 cores

--quick checks that every section still runs, not its numbers: stories260K on GSM8K in fp32
(--precisions to add bf16), 6 steps a row; one tokenize repeat; the default run at 4 steps
through dvc repro; the single and DDP rows of the strategy table at 2 steps, each evaluated
on 2 greedy generations. It is the docs' smoke command (tests/test_docs.py runs it with
FINETUNE_DOCS_BENCH=1 where the benchmarks' inputs are), so it stays short: 3:50 on a quiet
2-core Xeon (strategies 91 s of it; 76 s with the 2 generations), where it took 12:08 with bf16
rows and four 10-step strategy rows.

1. matmul ceiling (fp32, bf16) at each model's shapes; 2. training throughput, ours (padded,
packed rows, padding-free) vs transformers.Trainer, Alpaca (from FINETUNE_BENCH_DATA, bench/workdir.py) and GSM8K, three
models, fp32 and bf16; 3. tokenize stage vs bare tokenizer; 4. pipeline overheads; 5. the strategy table
(bench/strategies.py). Prints markdown tables and writes bench/results/suite-<device>.json.
Every ratio compares numbers measured in this run, in throwaway copies of the project.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from stages import pipeline_overheads, tokenize_throughput
from throughput import (DATASETS, LAYOUTS, MODELS, build_model, compare, matmul_ceiling,
                        n_params, prepare_data)
from workdir import ROOT, SHARED, copy_project, machine, markdown_table, set_params

SECTIONS = ("throughput", "tokenize", "overheads", "strategies")

COLUMNS = ["dataset", "model", "params_M", "precision", "hf_tok_s", "ours_padded_tok_s",
           "ours_packed_tok_s", "ours_padfree_tok_s", "ratio_padfree_vs_hf",
           "ratio_padded_vs_hf", "hf_padding", "ours_packed_padding", "ours_padfree_padding",
           "mfu_hf", "mfu_ours_best", "hf_loss", "ours_padded_loss", "ours_packed_loss",
           "ours_padfree_loss", "hf_rss_mb", "ours_padfree_rss_mb", "train_startup_s"]


def required_inputs(sections: list[str], datasets: list[str]) -> dict[Path, str]:
    """The files the chosen sections read beyond what the project ships -> what needs them."""
    alpaca, gpt2 = SHARED / "data/alpaca_2k.json", SHARED / "models/gpt2-tokenizer"
    needs: dict[Path, str] = {}
    if "throughput" in sections and "alpaca" in datasets:
        needs[alpaca] = "the throughput section's alpaca dataset"
    if "tokenize" in sections:
        needs.setdefault(alpaca, "the tokenize section")
        needs[gpt2 / "tokenizer.json"] = "the tokenize section (GPT-2 tokenizer)"
    return needs


def check_inputs(sections: list[str], datasets: list[str]) -> None:
    """Before any work: the first missing input in one line, exit 2 (a run that would fail
    after minutes of benchmarks fails now)."""
    for path, why in required_inputs(sections, datasets).items():
        if not path.exists():
            print(f"error: {path} not found, needed by {why}: set FINETUNE_BENCH_DATA to the "
                  "folder holding data/alpaca_2k.json and models/gpt2-tokenizer (bench/workdir.py),"
                  " or leave the section out (--skip tokenize, --datasets gsm8k)", file=sys.stderr)
            raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run of every section (stories260K, GSM8K, fp32, few steps)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per training run")
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS,
                    help="sections to skip: throughput tokenize overheads strategies")
    ap.add_argument("--models", nargs="*", choices=list(MODELS), help="default: all")
    ap.add_argument("--datasets", nargs="*", choices=list(DATASETS), help="default: all")
    ap.add_argument("--precisions", nargs="*", choices=["fp32", "bf16"],
                    help="default: both (bf16 on a CPU without bf16 matmul units is ~25x "
                         "slower than fp32: skip it for the 20M model there)")
    ap.add_argument("--layouts", nargs="*", choices=list(LAYOUTS),
                    help="our batch layouts to run (default: padded packed padfree)")
    ap.add_argument("--out", default="suite",
                    help="results file stem: bench/results/<out>-<device>.json")
    args = ap.parse_args()
    steps = 6 if args.quick else args.steps
    datasets = ["gsm8k"] if args.quick else (args.datasets or list(DATASETS))
    models = ["stories260K"] if args.quick else (args.models or list(MODELS))
    precisions = args.precisions or (["fp32"] if args.quick else ["fp32", "bf16"])
    check_inputs([s for s in SECTIONS if s not in args.skip], datasets)
    work = Path(tempfile.mkdtemp(prefix="bench-suite-"))
    out = {"machine": machine(), "steps": steps, "batch": 8}
    print(f"# Benchmark suite ({out['machine']['cpu']}, {out['machine']['cores']} cores, "
          f"torch {out['machine']['torch']}, device {out['machine']['device']})\n", flush=True)

    if "throughput" not in args.skip:
        model_dirs = {m: build_model(m, work / "models" / m) for m in models}
        rows = []
        for dataset in datasets:
            project = copy_project(work / f"data-{dataset}")
            prepare_data(project, dataset, max_len=512)
            for model in models:
                from transformers import AutoConfig

                cfg = AutoConfig.from_pretrained(model_dirs[model])
                params = n_params(model_dirs[model])
                for precision in precisions:
                    ceiling = matmul_ceiling(cfg.hidden_size, cfg.intermediate_size, precision)
                    rows.append(compare(project, dataset, model, model_dirs[model], precision,
                                        steps, ceiling, params, args.layouts or tuple(LAYOUTS)))
                    print(markdown_table(rows[-1:], COLUMNS), flush=True)
        out["throughput"] = rows
        print("\n## Training throughput (useful = non-pad tokens/s)\n")
        print(markdown_table(rows, COLUMNS), flush=True)

    if "tokenize" not in args.skip:
        project = copy_project(work / "tokenize")
        prepare_data(project, "alpaca", max_len=512)
        out["tokenize"] = tokenize_throughput(project, repeats=1 if args.quick else 10)
        print("\n## Tokenize stage vs bare tokenizer (GPT-2 tokenizer, Alpaca)\n")
        print(markdown_table([out["tokenize"]], list(out["tokenize"])), flush=True)

    if "overheads" not in args.skip:
        project = copy_project(work / "pipeline")
        if args.quick:
            set_params(project, {"training.max_steps": 4, "eval.max_generation_samples": 2})
        out["overheads"] = pipeline_overheads(project)
        print("\n## Pipeline overheads (the default run through dvc repro)\n")
        print(markdown_table([out["overheads"]], list(out["overheads"])), flush=True)

    if "strategies" not in args.skip:
        cmd = [sys.executable, str(ROOT / "bench/strategies.py"), "--out", "strategies-suite",
               *(["--steps", "2", "--only", "single", "ddp", "--generation-samples", "2"]
                 if args.quick else ["--steps", "50"])]
        subprocess.run(cmd, check=True)
        device = "cpu" if out["machine"]["device"] == "cpu" else "gpu"
        out["strategies"] = json.loads(
            (ROOT / f"bench/results/strategies-suite-{device}.json").read_text())

    device = "cpu" if out["machine"]["device"] == "cpu" else "gpu"
    name = f"{args.out}{'-quick' if args.quick else ''}-{device}.json"
    out["selection"] = {"models": models, "datasets": datasets, "skipped": args.skip,
                        "layouts": args.layouts or list(LAYOUTS),
                        "precisions": precisions}
    path = ROOT / "bench/results" / name
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
