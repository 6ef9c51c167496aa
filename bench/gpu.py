"""GPU mode of the benchmark: our engine vs transformers.Trainer on one GPU, same model, data,
precision, batch, steps and example order, with MFU against a matmul ceiling measured in the
same run. Needs only torch, transformers, peft, datasets and pydantic (no MLflow, DVC, Prefect),
so it runs on a GPU machine that has none of the orchestration stack.

    python bench/gpu.py --tokenized DIR --tokenizer DIR [--batch 32] [--steps 40]
                        [--layouts padded,packing,padding_free] [--out bench/results]

DIR is a train split tokenized by our tokenize stage (completion-only labels) with the
tokenizer in --tokenizer. The model is a ~0.41B Llama built from config with torch.manual_seed(0)
(hidden 1024, 24 layers, 16 heads, intermediate 2816, the tokenizer's vocabulary), full
fine-tuning, bf16 autocast over fp32 weights, fused AdamW. Useful tokens/s counts non-pad
tokens of steps 6..N (warm-up and compilation excluded); MFU = 6 x params x tokens/s / the
bf16 matmul rate measured here. Refuses to run without CUDA (one line).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
         "num_attention_heads": 16, "num_key_value_heads": 16,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
WARMUP = 5  # steps excluded from tokens/s (allocator warm-up, cuDNN/cuBLAS planning, compile)


def matmul_ceiling() -> float:
    """bf16 8192^3 matmul TFLOP/s, median of 10 after warm-up."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / sorted(times)[len(times) // 2] / 1e12


def build_model(tokenizer: Path, dest: Path) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), **SHAPE)
    model = LlamaForCausalLM(config)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return sum(p.numel() for p in model.parameters())


def order(n: int, batch: int, steps: int, seed: int = 42) -> list[int]:
    """Our trainer's example order (engine.data.ShardedBatches, one rank), for HF to read
    sequentially."""
    from engine.data import ShardedBatches

    batches = ShardedBatches(n, batch, 0, 1, seed)
    out: list[int] = []
    epoch = 0
    while len(out) < batch * steps:
        out += [i for b in batches.epoch(epoch) for i in b]
        epoch += 1
    return out[: batch * steps]


def run_ours(name: str, layout: dict, args, model: Path, out: Path) -> dict:
    from engine_smoke import launch

    overrides = {
        "model.name_or_path": str(model), "peft.use_peft": False,
        "training.mixed_precision": "bf16", "training.max_steps": args.steps,
        "training.per_device_train_batch_size": args.batch, "training.max_grad_norm": 1.0,
        "optimizer.learning_rate": 1e-3, "optimizer.kwargs": {"fused": True},
        "scheduler.warmup_steps": 2, "checkpoint.save_strategy": "no",
        "eval.eval_strategy": "no", "logging.logging_steps": 1, "logging.report_to": ["jsonl"],
        "logging.logging_dir": str(out / name / "logs"), "data.max_seq_length": 1024, **layout}
    work = out / name
    proc = launch(work, overrides, args.tokenized, None)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    with open(work / "plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    timed = rows[WARMUP:]
    # each row is one step (logging_steps 1): tokens / (tokens / tokens_per_second) = seconds
    tokens = float(rows[-1]["num_input_tokens_seen"]) - float(
        rows[WARMUP - 1]["num_input_tokens_seen"])
    seconds = sum((float(r["num_input_tokens_seen"]) - float(p["num_input_tokens_seen"]))
                  / float(r["tokens_per_second"]) for p, r in zip(rows[WARMUP - 1:], timed))
    metrics = json.loads((work / "train.json").read_text())
    logged = [json.loads(x) for x in (work / "logs/train_log.jsonl").read_text().splitlines()]
    peak_mb = max(r.get("cuda_max_memory_allocated_mb", 0) for r in logged)
    kernel = next((ln for ln in proc.stdout.splitlines() if "attention" in ln and "[train]" in ln),
                  "")
    return {"tokens_per_s": tokens / seconds, "final_loss": float(rows[-1]["loss"]),
            "losses": [float(r["loss"]) for r in rows],
            "peak_gib": peak_mb / 1024,
            "padding_fraction": metrics["padding_fraction"], "note": kernel.strip()}


def run_hf(args, model: Path, out: Path) -> dict:
    spec = {"train": str(args.tokenized), "model": str(model), "threads": 8, "seed": 42,
            "precision": "bf16", "batch": args.batch, "steps": args.steps,
            "learning_rate": 1e-3, "weight_decay": 0.0, "warmup_steps": 2,
            "output_dir": str(out / "hf"), "device": "cuda", "warmup_window": WARMUP,
            "order": order(_rows(args.tokenized), args.batch, args.steps)}
    (out / "hf").mkdir(parents=True, exist_ok=True)
    (out / "hf/spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(ROOT / "bench/hf_trainer.py"),
                           str(out / "hf/spec.json"), str(out / "hf/result.json")],
                          capture_output=True, text=True)
    (out / "hf/log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    r = json.loads((out / "hf/result.json").read_text())
    return {"tokens_per_s": r["window_tokens"] / r["window_seconds"],
            "final_loss": r["losses"][-1], "losses": r["losses"],
            "peak_gib": r.get("cuda_peak_gib", 0.0), "padding_fraction": r["padding_fraction"],
            "note": "transformers.Trainer, DataCollatorForSeq2Seq"}


def _rows(path: Path) -> int:
    import datasets

    return len(datasets.load_from_disk(str(path)))


COMPILE = {"training.torch_compile": True, "training.torch_compile_dynamic": True}
# packed rows of one fixed shape (pad_to_multiple_of = the row length): one compiled graph,
# one attention plan
LAYOUTS = {"padded": {}, "packing": {"training.packing": True,
                                     "training.packed_sequence_length": 2048,
                                     "training.pad_to_multiple_of": 2048},
           "padding_free": {"training.padding_free": True}}
LAYOUTS.update({f"{name}+compile": {**layout, **COMPILE} for name, layout in list(LAYOUTS.items())})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenized", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layouts", default="padded,packing,padding_free")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-gpu"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: no CUDA device here; run it on a GPU machine "
                         "(bench/suite.py is the CPU benchmark)")
    device = torch.cuda.get_device_name()
    peak = matmul_ceiling()
    args.work.mkdir(parents=True, exist_ok=True)
    n_params = build_model(args.tokenizer, args.work / "model")
    results = {} if args.skip_hf else {"HF Trainer": run_hf(args, args.work / "model", args.work)}
    for name in args.layouts.split(","):
        started = time.perf_counter()
        r = results[f"ours, {name}"] = run_ours(name, LAYOUTS[name], args,
                                                args.work / "model", args.work)
        shown = (f"{r['tokens_per_s']:,.0f} useful tok/s, final loss {r['final_loss']:.5f}"
                 if "error" not in r else "failed")
        print(f"{name}: {time.perf_counter() - started:.0f} s, {shown}", flush=True)
    base = results.get("HF Trainer", {}).get("tokens_per_s")
    print(f"\n{device}, torch {torch.__version__}; {n_params / 1e6:.0f}M params, batch "
          f"{args.batch}, steps {WARMUP + 1}..{args.steps} timed; bf16 peak {peak:.0f} TFLOP/s\n")
    print("| run | useful tok/s | vs HF | MFU | peak GiB | padding | final loss | note |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed | | | | | | {r['error'][-300:]!r} |")
            continue
        mfu = 6 * n_params * r["tokens_per_s"] / (peak * 1e12)
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu:.1%} | "
              f"{r['peak_gib']:.1f} | {r['padding_fraction']:.2f} | {r['final_loss']:.5f} | "
              f"{r['note']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = device.replace(" ", "-").lower()
    (args.out / f"gpu-{stem}.json").write_text(json.dumps({
        "device": device, "torch": torch.__version__, "python": platform.python_version(),
        "params": n_params, "batch": args.batch, "steps": args.steps, "bf16_peak_tflops": peak,
        "results": results}, indent=2))


if __name__ == "__main__":
    main()
