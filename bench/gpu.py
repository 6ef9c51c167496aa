"""GPU benchmark: our engine against transformers.Trainer and TRL's SFTTrainer on one GPU, same
model, data, precision, batch, steps and example order, with MFU against a matmul ceiling
measured in the same run. Needs torch, transformers and peft (what a GPU machine has) plus
datasets, pydantic, trl and liger-kernel (carried as wheels); no MLflow, DVC or Prefect.

    python bench/gpu.py --data DIR [--batch 32] [--window 8] [--rows "NAME;NAME"] [--out DIR]
    python bench/gpu.py --data DIR --rows NAME --profile   # where a row's step time goes

DIR holds `alpaca-train` (Alpaca 2k through our tokenize stage, GPT-2 tokenizer, completion-only
labels) and `tokenizer`, as bench/gpu_prep.py writes them. The model is a ~0.41B Llama built
from config with torch.manual_seed(0) (hidden 1024, 24 layers, 16 heads, intermediate 2816, the
tokenizer's vocabulary), full fine-tuning, bf16 autocast over fp32 weights, fused AdamW.

Every row trains WARMUP steps, then three timed windows of --window steps; a window's time runs
between device-synchronised marks at its boundaries (bench/gpu_timer.py, the same callback for
every trainer), and a row's useful tokens/s is the median of its three windows (non-pad tokens
only). MFU = 6 x params x tokens/s / the bf16 matmul rate measured here (attention FLOPs not
counted). Prints the markdown table and writes bench/results/gpu-<device>.json. Refuses to run
without CUDA (one line).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
         "num_attention_heads": 16, "num_key_value_heads": 16,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
#: steps before the first window (allocator warm-up, kernel planning, compilation and the
#: recompile that makes the bucketed dimensions dynamic, seen at steps 6-11 on an H100)
WARMUP = 10
LONG = 2048  # the long-row rows' length

# our engine's settings per row (layouts, compile, Liger); bucketed shapes for compile
LAYOUT = {
    "padded": {"training.pad_to_multiple_of": 64},
    "packing": {"training.packing": True, "training.packed_sequence_length": LONG,
                "training.pad_to_multiple_of": LONG},
    "padding_free": {"training.padding_free": True, "training.pad_to_multiple_of": 512},
}
COMPILE = {"training.torch_compile": True, "training.dynamo_recompile_limit": 32}
LIGER = {"training.use_liger_kernel": True}


def our_rows() -> dict[str, dict]:
    rows = {}
    for layout, settings in LAYOUT.items():
        for compiled in (False, True):
            for liger in (False, True):
                name = f"ours {layout}" + (" + compile" if compiled else "") + (
                    " + Liger" if liger else "")
                rows[name] = {"kind": "ours", "overrides": {
                    **settings, **(COMPILE if compiled else {}), **(LIGER if liger else {})}}
    rows["ours padding_free + compile(model) + Liger"] = {"kind": "ours", "overrides": {
        **LAYOUT["padding_free"], **COMPILE, **LIGER, "training.torch_compile_scope": "model"}}
    whole = {"training.torch_compile_scope": "model"}
    rows["ours padding_free + compile(model)"] = {"kind": "ours", "overrides": {
        **LAYOUT["padding_free"], **COMPILE, **whole}}
    rows[f"ours {LONG}-token rows, packed Alpaca + compile(model)"] = {
        "kind": "ours", "long": "packed", "overrides": {
            **LAYOUT["packing"], **COMPILE, **whole,
            "training.per_device_train_batch_size": 128}}
    rows["ours padding_free + compile (CUDA graphs)"] = {"kind": "ours", "overrides": {
        **LAYOUT["padding_free"], **COMPILE, "training.torch_compile_mode": "reduce-overhead"}}
    for liger in (False, True):
        tail = " + Liger" if liger else ""
        rows[f"ours {LONG}-token rows, packed Alpaca + compile{tail}"] = {
            "kind": "ours", "long": "packed", "overrides": {
                **LAYOUT["packing"], **COMPILE, **(LIGER if liger else {}),
                "training.per_device_train_batch_size": 128}}
        rows[f"ours {LONG}-token rows, padded layout + compile{tail}"] = {
            "kind": "ours", "long": "rows", "overrides": {
                **COMPILE, **(LIGER if liger else {}),
                "training.per_device_train_batch_size": 8}}
    return rows


ROWS = {
    "HF Trainer": {"kind": "hf"},
    "HF Trainer, cuDNN SDPA off": {"kind": "hf", "cudnn": False},
    "TRL SFTTrainer padding_free (cuDNN SDPA off)": {"kind": "trl", "cudnn": False},
    "TRL SFTTrainer padding_free + Liger (cuDNN SDPA off)": {"kind": "trl", "cudnn": False,
                                                             "liger": True},
    **our_rows(),
}


#: what one call measures (in this order: the rows the issue's targets read first), within
#: the 9 minutes a device call allows; every row of ROWS can be asked for with --rows
DEFAULT_ROWS = [
    "HF Trainer, cuDNN SDPA off", "TRL SFTTrainer padding_free + Liger (cuDNN SDPA off)",
    "ours padding_free + compile", f"ours {LONG}-token rows, packed Alpaca + compile",
    f"ours {LONG}-token rows, padded layout + compile", "HF Trainer",
    "TRL SFTTrainer padding_free (cuDNN SDPA off)", "ours padding_free",
    "ours padding_free + Liger", "ours padding_free + compile + Liger", "ours packing",
    "ours packing + compile", "ours padded", "ours padded + compile",
]


def matmul_ceiling() -> float:
    """bf16 8192^3 matmul TFLOP/s, median of 10 after warm-up (random data)."""
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
    return 2 * 8192**3 / statistics.median(times) / 1e12


def build_model(tokenizer: Path, dest: Path) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **SHAPE))
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return sum(p.numel() for p in model.parameters())


def long_rows(train: Path, dest: Path, n_rows: int) -> Path:
    """Alpaca's token ids laid end to end and cut into rows of exactly LONG tokens, every
    token trained (text mode): no padding and no example boundaries."""
    import datasets

    ids = [t for row in datasets.load_from_disk(str(train))["input_ids"] for t in row]
    rows = [ids[i * LONG:(i + 1) * LONG] for i in range(min(n_rows, len(ids) // LONG))]
    datasets.Dataset.from_dict({"input_ids": rows, "labels": rows,
                                "length": [LONG] * len(rows)}).save_to_disk(str(dest))
    return dest


def order(n: int, batch: int, steps: int, seed: int = 42) -> list[int]:
    """Our trainer's example order (engine.datapath.data.ShardedBatches, one rank), for HF/TRL to
    read sequentially: the same examples at every step."""
    from engine.datapath.data import ShardedBatches

    batches = ShardedBatches(n, batch, 0, 1, seed)
    out: list[int] = []
    epoch = 0
    while len(out) < batch * steps:
        out += batches.epoch(epoch).ravel().tolist()
        epoch += 1
    return out[: batch * steps]


def boundaries(window: int) -> list[int]:
    return [WARMUP + i * window for i in range(4)]


def our_overrides(spec: dict, args, model: Path, steps: int) -> dict:
    """Our engine's settings for a row: the bench's common ones, then the row's own."""
    return {
        "model.name_or_path": str(model), "peft.use_peft": False,
        "training.mixed_precision": "bf16", "training.max_steps": steps,
        "training.per_device_train_batch_size": args.batch, "training.max_grad_norm": 1.0,
        "optimizer.learning_rate": 1e-3, "optimizer.weight_decay": 0.0,
        "optimizer.kwargs": {"fused": True}, "scheduler.name": "cosine",
        "scheduler.warmup_steps": 2, "checkpoint.save_strategy": "no",
        "eval.eval_strategy": "no", "logging.logging_steps": 1, "logging.report_to": [],
        "data.max_seq_length": 1024 if spec.get("long") != "rows" else LONG,
        **spec["overrides"]}


#: --profile: steps traced after the warm-up (one more before them, thrown away)
PROFILED = 2


def profile_ours(name: str, spec: dict, args, model: Path, train: Path, work: Path) -> dict:
    """The row's run, shortened to the warm-up and PROFILED steps, those traced by
    `logging.profiler` (no timed windows: tracing slows the steps it records). Returns the
    ops table (self CUDA time first) and where the trace is."""
    from engine_smoke import launch

    traces = work / "profile"
    overrides = {**our_overrides(spec, args, model, WARMUP + 1 + PROFILED),
                 "logging.profiler.enabled": True, "logging.profiler.wait_steps": WARMUP,
                 "logging.profiler.warmup_steps": 1,
                 "logging.profiler.active_steps": PROFILED,
                 "logging.profiler.output_dir": str(traces)}
    proc = launch(work, overrides, train, None)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2500:]}
    ops = sorted(traces.glob("ops-*.txt"))
    if not ops:
        return {"error": f"no ops table under {traces}: {proc.stdout[-1000:]}"}
    return {"ops_table": ops[0].read_text(), "trace": str(sorted(traces.glob("trace-*"))[0])}


def run_ours(name: str, spec: dict, args, model: Path, train: Path, work: Path) -> dict:
    from engine_smoke import launch

    if args.profile:
        return profile_ours(name, spec, args, model, train, work)
    timer = work / "marks.jsonl"
    overrides = {**our_overrides(spec, args, model, WARMUP + 3 * args.window),
                 "logging.callbacks": [{"class": "bench.gpu_timer:WindowTimer", "kwargs": {
                     "path": str(timer), "boundaries": boundaries(args.window)}}]}
    proc = launch(work, overrides, train, None)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2500:]}
    with open(work / "plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    seen = [0.0] + [float(r["num_input_tokens_seen"]) for r in rows]
    per_step = [b - a for a, b in zip(seen, seen[1:])]
    from gpu_timer import windows

    metrics = json.loads((work / "train.json").read_text())
    notes = [ln.strip() for ln in proc.stdout.splitlines()
             if ln.startswith("[train]") and any(w in ln for w in ("attention", "liger"))]
    return {"windows": windows(str(timer), per_step), "final_loss": float(rows[-1]["loss"]),
            "losses": [float(r["loss"]) for r in rows],
            "peak_gib": metrics.get("cuda_max_memory_allocated_mb", 0) / 1024,
            "padding_fraction": metrics["padding_fraction"],
            "compile_graphs": metrics.get("torch_compile_graphs"),
            "note": "; ".join(notes)}


def run_hf(name: str, spec: dict, args, model: Path, train: Path, work: Path) -> dict:
    import datasets

    steps = WARMUP + 3 * args.window
    timer = work / "marks.jsonl"
    job = {"train": str(train), "model": str(model), "threads": 8, "seed": 42,
           "precision": "bf16", "batch": args.batch, "steps": steps, "learning_rate": 1e-3,
           "weight_decay": 0.0, "warmup_steps": 2, "output_dir": str(work / "out"),
           "device": "cuda", "order": order(len(datasets.load_from_disk(str(train))),
                                            args.batch, steps),
           "trainer": spec["kind"], "cudnn": spec.get("cudnn", True),
           "liger": spec.get("liger", False),
           "timer": {"path": str(timer), "boundaries": boundaries(args.window)}}
    (work / "spec.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(ROOT / "bench/hf_trainer.py"),
                           str(work / "spec.json"), str(work / "result.json")],
                          capture_output=True, text=True)
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2500:]}
    from gpu_timer import windows

    r = json.loads((work / "result.json").read_text())
    return {"windows": windows(str(timer), r["tokens_per_step"]),
            "final_loss": r["losses"][-1], "losses": r["losses"],
            "peak_gib": r.get("cuda_peak_gib", 0.0), "padding_fraction": r["padding_fraction"],
            "note": ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--window", type=int, default=8, help="steps per timed window")
    ap.add_argument("--rows", default="",
                    help="row names separated by ; (default: DEFAULT_ROWS)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-gpu"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds; rows not started by then are reported as skipped")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing, trace our rows' steps after the warm-up "
                    "(logging.profiler) and print each one's ops table by self CUDA time")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: no CUDA device here; run it on a GPU machine "
                         "(bench/suite.py is the CPU benchmark)")
    started = time.perf_counter()
    chosen = [r.strip() for r in args.rows.split(";") if r.strip()] or DEFAULT_ROWS
    unknown = [r for r in chosen if r not in ROWS]
    if unknown:
        raise SystemExit(f"bench/gpu.py: unknown rows {unknown}; rows: {list(ROWS)}")
    device = torch.cuda.get_device_name()
    peak = matmul_ceiling()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    n_params = build_model(args.data / "tokenizer", model)
    torch.cuda.empty_cache()
    alpaca = args.data / "alpaca-train"
    long = long_rows(alpaca, args.work / "long-rows", 8 * (WARMUP + 3 * args.window))
    results: dict[str, dict] = {}
    for name in chosen:
        spec = ROWS[name]
        if time.perf_counter() - started > args.budget:
            results[name] = {"error": "skipped: --budget spent"}
            continue
        work = args.work / name.replace(" ", "_").replace(",", "").replace("(", "").replace(
            ")", "").replace("+", "p")
        work.mkdir(parents=True, exist_ok=True)
        train = long if spec.get("long") == "rows" else alpaca
        t0 = time.perf_counter()
        runner = run_ours if spec["kind"] == "ours" else run_hf
        if args.profile and spec["kind"] != "ours":
            results[name] = {"error": "skipped: --profile traces our engine's rows only"}
            continue
        r = results[name] = runner(name, spec, args, model, train, work)
        if "ops_table" in r:
            print(f"{name}: trace {r['trace']}\n{r['ops_table']}", flush=True)
            continue
        if "windows" in r:
            r["tokens_per_s"] = statistics.median(r["windows"])
            r["mfu"] = 6 * n_params * r["tokens_per_s"] / (peak * 1e12)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        shown = (f"{r['tokens_per_s']:,.0f} useful tok/s (windows "
                 f"{', '.join(f'{w:,.0f}' for w in r['windows'])}), final loss "
                 f"{r['final_loss']:.5f}" if "windows" in r else r["error"][-600:])
        print(f"{name}: {r['wall_s']:.0f} s, {shown}", flush=True)
    if args.profile:
        return
    base = results.get("HF Trainer, cuDNN SDPA off", {}).get("tokens_per_s")
    trl = results.get("TRL SFTTrainer padding_free + Liger (cuDNN SDPA off)", {}).get(
        "tokens_per_s")
    hf_loss = results.get("HF Trainer, cuDNN SDPA off", {}).get("final_loss")
    print(f"\n{device}, torch {torch.__version__}; {n_params / 1e6:.0f}M params, batch "
          f"{args.batch} (long rows: their own), {WARMUP} warm-up steps then 3 windows of "
          f"{args.window}; median window; bf16 peak {peak:.0f} TFLOP/s; total "
          f"{time.perf_counter() - started:.0f} s\n")
    print("| run | useful tok/s | vs HF (cuDNN off) | vs TRL+Liger | MFU | peak GiB | "
          "padding | final loss | vs HF loss | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "windows" not in r:
            print(f"| {name} | failed | | | | | | | | {r['error'][-200:]!r} |")
            continue
        tps = r["tokens_per_s"]
        vs_hf = f"{tps / base:.2f}x" if base else "-"
        vs_trl = f"{tps / trl:.2f}x" if trl else "-"
        dl = (f"{(r['final_loss'] - hf_loss) / hf_loss:+.2%}" if hf_loss and "2048" not in name
              else "-")
        print(f"| {name} | {tps:,.0f} | {vs_hf} | {vs_trl} | {r['mfu']:.1%} | "
              f"{r['peak_gib']:.1f} | {r['padding_fraction']:.2f} | {r['final_loss']:.5f} | "
              f"{dl} | {r['note']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = device.replace(" ", "-").lower()
    (args.out / f"gpu-{stem}.json").write_text(json.dumps({
        "device": device, "torch": torch.__version__, "python": platform.python_version(),
        "params": n_params, "batch": args.batch, "warmup_steps": WARMUP,
        "window_steps": args.window, "bf16_peak_tflops": peak, "results": results}, indent=2))


if __name__ == "__main__":
    main()
