"""GPU benchmark: our engine against transformers.Trainer and TRL's SFTTrainer on one GPU, each
peer at its settings (eager and compiled, Liger or not), same model, batches, precision, steps
and example order, with MFU against a matmul ceiling measured in the same run. Needs torch,
transformers and peft (what a GPU machine has) plus datasets, pydantic, trl and liger-kernel
(carried as wheels); no MLflow, DVC or Prefect.

    python bench/gpu.py --data DIR [--batch 32] [--window 8] [--rows "NAME;NAME"] [--out DIR]
    python bench/gpu.py --data DIR --merge gpu-<device>.json   # a second machine start
    python bench/gpu.py --data DIR --rows "NAME;NAME" --profile   # where each step's time goes
    python bench/gpu.py --data DIR --smoke --batch 4 --window 2   # this script, on a CPU

DIR holds `alpaca-train` (Alpaca 2k through our tokenize stage, GPT-2 tokenizer, completion-only
labels) and `tokenizer`, as bench/gpu_prep.py writes them. The model is a ~0.41B Llama built
from config with torch.manual_seed(0) (hidden 1024, 24 layers, 16 heads, intermediate 2816, the
tokenizer's vocabulary), full fine-tuning, bf16 autocast over fp32 weights, fused AdamW.

The SFT rows train on HF group_by_length's first batches over the split, laid out so that our
seeded order reads the same batches (bench/same_batches.py): HF pads only within length-sorted
batches, its best setting, and equal losses check that the rows compute the same thing. The
2048-token rows read their own data. Every row trains WARMUP steps, then three timed windows of
--window steps; a window's time runs between device-synchronised marks at its boundaries
(bench/gpu_timer.py, the same callback for every trainer), and a row's useful tokens/s is the
median of its three windows (non-pad tokens only). MFU = 6 x params x tokens/s / the bf16
matmul rate measured here (attention FLOPs not counted). The table names the best peer row and
takes every ratio against it within one machine start; the record (--out/gpu-<device>.json,
written after every row) counts `starts`, and --merge adds this start's rows to an earlier
start's record, so ratios become ranges. --fold adds bench/dpo_gpu.py's rows to a record.
Refuses to run without CUDA (one line) unless --smoke.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import shutil
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
#: the 1B-class rows' model: Llama 3.2 1B's shape (16 layers x 2048 hidden, 32 query and 8
#: key/value heads, tied embeddings) with the tokenizer's vocabulary (~1.08B with GPT-2's)
SHAPE_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 4096, "tie_word_embeddings": True}
SHAPES = {"0.41B": SHAPE, "1B": SHAPE_1B}
#: --smoke's model: the same code paths in seconds on a CPU
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4}
SMOKE_SHAPES = {"0.41B": SMOKE_SHAPE, "1B": {**SMOKE_SHAPE, "num_key_value_heads": 2}}
#: steps before the first window (allocator warm-up, kernel planning, compilation and the
#: recompile that makes the bucketed dimensions dynamic, seen at steps 6-11 on an H100)
WARMUP = 10
LONG = 2048  # the long-row rows' length
SEED = 42  # our engine's data order seed (training.seed's default), HF's group_by_length seed

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
    # the 1B-class rows (SHAPE_1B): Alpaca packed into 2048-token rows, full fine-tuning and
    # LoRA (r 16 on every linear layer), bf16 autocast, regional compile
    lora = {"peft.use_peft": True, "peft.r": 16, "peft.lora_alpha": 32,
            "peft.target_modules": "all-linear"}
    for tuned, extra in (("full", {}), ("LoRA", lora)):
        rows[f"ours 1B {LONG}-token rows, packed Alpaca + compile, {tuned}"] = {
            "kind": "ours", "long": "packed", "shape": "1B", "overrides": {
                **LAYOUT["packing"], **COMPILE, **extra,
                "training.per_device_train_batch_size": 128},
            # LoRA computes no weight gradients of the base: 4 x params FLOPs a token, not 6
            "flops_per_param": 4 if extra else 6}
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


def peer_rows() -> dict[str, dict]:
    """HF Trainer (group_by_length: every row here reads its batches) and TRL's SFTTrainer
    (padding_free), each eager and compiled (`torch_compile=True`), TRL with and without
    Liger; cuDNN SDPA off where it was the faster setting on an H100 (HF: 21,435 against
    13,240 useful tok/s)."""
    rows = {"HF Trainer group_by_length": {"kind": "hf"}}
    for compiled in (False, True):
        tail = " + compile" if compiled else ""
        rows[f"HF Trainer group_by_length{tail}, cuDNN SDPA off"] = {
            "kind": "hf", "cudnn": False, "compile": compiled}
        for liger in (False, True):
            name = f"TRL SFTTrainer padding_free{tail}" + (" + Liger" if liger else "")
            rows[f"{name} (cuDNN SDPA off)"] = {"kind": "trl", "cudnn": False,
                                                "compile": compiled, "liger": liger}
    return rows


ROWS = {**peer_rows(), **our_rows()}
RECOMMENDED = "ours padding_free + compile"


#: what one call measures, most telling first (HF and TRL at their best settings, ours
#: recommended, the long packed rows' MFU), within the minutes a device call allows; every row
#: of ROWS can be asked for with --rows
DEFAULT_ROWS = [
    "HF Trainer group_by_length + compile, cuDNN SDPA off",
    "TRL SFTTrainer padding_free + compile (cuDNN SDPA off)", RECOMMENDED,
    "HF Trainer group_by_length, cuDNN SDPA off", "TRL SFTTrainer padding_free (cuDNN SDPA off)",
    f"ours {LONG}-token rows, packed Alpaca + compile",
    "TRL SFTTrainer padding_free + compile + Liger (cuDNN SDPA off)",
    "TRL SFTTrainer padding_free + Liger (cuDNN SDPA off)", "HF Trainer group_by_length",
    "ours padding_free", "ours packing + compile", "ours padded + compile",
]


def is_peer(name: str) -> bool:
    """A peer's SFT row on the shared batches (the rows a 'best peer' is chosen from)."""
    return name.startswith(("HF", "TRL")) and "DPO" not in name


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


def build_model(tokenizer: Path, dest: Path, shape: dict | None = None) -> int:
    """A Llama of `shape` (default SHAPE) with the tokenizer's vocabulary, from config after
    torch.manual_seed(0), saved with the tokenizer; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **(shape or SHAPE)))
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


def grouped_split(train: Path, dest: Path, batch: int, steps: int) -> Path:
    """A copy of the train split holding HF group_by_length's first `steps` batches over the
    whole split (what its sampler trains on first in a real run), laid out so that our engine
    reads the same batches in the same order (bench/same_batches.py). Every SFT row reads it:
    HF at its best setting pads only within a length-sorted batch, and equal losses across
    trainers check that the rows are the same computation."""
    import datasets

    from same_batches import hf_grouped_batches, read_in_our_order

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(train, dest)
    lengths = [len(ids) for ids in datasets.load_from_disk(str(dest))["input_ids"]]
    batches = hf_grouped_batches(lengths, batch, SEED)[:steps]
    read_in_our_order(dest, [i for b in batches for i in b], batch, steps, SEED)
    return dest


def merge_starts(earlier: dict | None, now: dict) -> dict:
    """This call's rows added to an earlier machine start's record of the same device: each
    row keeps its latest values and gains `per_start` (one entry per start that measured it),
    and `starts` counts the starts. Ratios are taken within a start (the same machine)."""
    if earlier is not None and earlier["device"] != now["device"]:
        raise SystemExit(f"--merge: {earlier['device']} is not this device ({now['device']})")
    starts = (earlier["starts"] if earlier else 0) + 1
    merged = dict(earlier["results"]) if earlier else {}
    add_rows(merged, now["results"], starts)
    return {**now, "starts": starts, "results": merged}


def add_rows(merged: dict, rows: dict, start: int) -> None:
    """`rows` measured in machine start `start`, added to `merged` (see merge_starts)."""
    for name, r in rows.items():
        if "tokens_per_s" not in r and "pairs_per_s" not in r:
            merged.setdefault(name, r)
            continue
        before = merged.get(name, {}).get("per_start", [])
        keep = {k: r[k] for k in ("tokens_per_s", "pairs_per_s", "windows", "final_loss",
                                  "mfu", "peak_gib") if k in r}
        merged[name] = {**r, "per_start": before + [{"start": start, **keep}]}


def best_peer(results: dict, start: int) -> tuple[str, float] | None:
    """The fastest peer SFT row measured in machine start `start`."""
    seen = [(name, s["tokens_per_s"]) for name, r in results.items() if is_peer(name)
            for s in r.get("per_start", []) if s["start"] == start and "tokens_per_s" in s]
    return max(seen, key=lambda x: x[1]) if seen else None


def spread(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)} to {fmt.format(high)}"


def table(record: dict) -> str:
    """One row per run: its tokens/s, and its ratio to the best peer row of the same machine
    start, as a range over the starts that measured both."""
    results, starts = record["results"], record["starts"]
    bests = {k: best_peer(results, k) for k in range(1, starts + 1)}
    names = {k: b[0] for k, b in bests.items() if b}
    lines = [f"best peer row per machine start: {names}", "",
             "| run | useful tok/s | vs best peer | MFU | peak GiB | padding | final loss | "
             "vs best peer loss | note |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        per = r.get("per_start", [])
        if "DPO" in name:
            continue
        if not per or "tokens_per_s" not in per[0]:
            said = "skipped" if r.get("error", "").startswith("skipped") else "failed"
            lines.append(f"| {name} | {said} | | | | | | | {r.get('error', '')[-200:]!r} |")
            continue
        ratios, dloss = [], []
        for s in per:
            best = bests.get(s["start"])
            if best:
                ratios.append(s["tokens_per_s"] / best[1])
                ref = results[best[0]]["per_start"]
                ref_loss = [x["final_loss"] for x in ref if x["start"] == s["start"]][0]
                if "2048" not in name:
                    dloss.append((s["final_loss"] - ref_loss) / ref_loss)
        lines.append(
            f"| {name} | {spread([s['tokens_per_s'] for s in per], '{:,.0f}')} | "
            f"{spread(ratios, '{:.2f}x') if ratios else '-'} | "
            f"{spread([s['mfu'] for s in per], '{:.1%}')} | {r['peak_gib']:.1f} | "
            f"{r['padding_fraction']:.2f} | {r['final_loss']:.5f} | "
            f"{spread(dloss, '{:+.2%}') if dloss else '-'} | {r['note']} |")
    dpo = {name: r for name, r in results.items() if "DPO" in name}
    if dpo:
        lines += ["", "| DPO run | pairs/s | useful tok/s | vs best TRL DPO row | final loss | "
                  "peak GiB |", "|---|---|---|---|---|---|"]
    for name, r in dpo.items():
        per = r.get("per_start", [])
        if not per:
            lines.append(f"| {name} | failed | | | | {r.get('error', '')[-200:]!r} |")
            continue
        ratios = []
        for s in per:
            trl = [x["pairs_per_s"] for n, o in dpo.items() if n.startswith("TRL")
                   for x in o.get("per_start", []) if x["start"] == s["start"]]
            if trl:
                ratios.append(s["pairs_per_s"] / max(trl))
        lines.append(f"| {name} | {spread([s['pairs_per_s'] for s in per], '{:,.1f}')} | "
                     f"{spread([s['tokens_per_s'] for s in per], '{:,.0f}')} | "
                     f"{spread(ratios, '{:.2f}x') if ratios else '-'} | "
                     f"{r['final_loss']:.5f} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def save(args, device: str, n_params: int, peak: float, results: dict) -> dict:
    """The record so far (merged with --merge's earlier start), written to
    --out/gpu-<device>.json."""
    import torch

    record = {"device": device, "torch": torch.__version__,
              "python": platform.python_version(), "params": n_params, "batch": args.batch,
              "warmup_steps": WARMUP, "window_steps": args.window, "bf16_peak_tflops": peak,
              "batches": "HF group_by_length's first batches, read by every SFT row",
              "results": dict(results)}
    record = merge_starts(args.earlier, record)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"gpu-{device.replace(' ', '-').lower()}.json"
    out.write_text(json.dumps(record, indent=2))
    return record


def boundaries(window: int, warmup: int = WARMUP) -> list[int]:
    """The optimizer steps that open and close the three timed windows."""
    return [warmup + i * window for i in range(4)]


def our_overrides(spec: dict, args, model: Path, steps: int) -> dict:
    """Our engine's settings for a row: the bench's common ones, then the row's own."""
    return {
        "model.name_or_path": str(model / spec.get("shape", "0.41B")), "peft.use_peft": False,
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
    return traced(traces, proc.stdout)


def traced(traces: Path, log: str) -> dict:
    """The ops table and trace a profiled row wrote (logging.profiler's files)."""
    ops = sorted(traces.glob("ops-*.txt"))
    if not ops:
        return {"error": f"no ops table under {traces}: {log[-1000:]}"}
    return {"ops_table": ops[0].read_text(), "trace": str(sorted(traces.glob("trace-*"))[0])}


def summarise_traces(traces: dict[str, Path], out: Path) -> None:
    """--profile: the traced rows side by side (bench/trace_summary.py) in
    out/profile-summary.md (and .json), and each trace gzipped beside it."""
    import gzip

    from trace_summary import load, summarise, table

    out.mkdir(parents=True, exist_ok=True)
    summaries = {name: summarise(load(path)) for name, path in traces.items()}
    (out / "profile-summary.md").write_text(table(summaries) + "\n")
    (out / "profile-summary.json").write_text(json.dumps(summaries, indent=1))
    for name, path in traces.items():
        slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
        with open(path, "rb") as src, gzip.open(out / f"trace-{slug[:60]}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    print(f"profile summary: {out / 'profile-summary.md'}", flush=True)


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

    from same_batches import our_order

    steps = WARMUP + 1 + PROFILED if args.profile else WARMUP + 3 * args.window
    timer = work / "marks.jsonl"
    traces = work / "profile"
    job = {"train": str(train), "model": str(model / spec.get("shape", "0.41B")), "threads": 8, "seed": 42,
           "precision": "bf16", "batch": args.batch, "steps": steps, "learning_rate": 1e-3,
           "weight_decay": 0.0, "warmup_steps": 2, "output_dir": str(work / "out"),
           "device": args.device, "order": our_order(len(datasets.load_from_disk(str(train))),
                                                args.batch, steps, SEED),
           "trainer": spec["kind"], "cudnn": spec.get("cudnn", True),
           "liger": spec.get("liger", False), "compile": spec.get("compile", False),
           **({"profile": {"out_dir": str(traces), "wait": WARMUP, "active": PROFILED}}
              if args.profile else
              {"timer": {"path": str(timer), "boundaries": boundaries(args.window)}})}
    (work / "spec.json").write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(ROOT / "bench/hf_trainer.py"),
                           str(work / "spec.json"), str(work / "result.json")],
                          capture_output=True, text=True)
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2500:]}
    if args.profile:
        return traced(traces, proc.stdout)
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
    ap.add_argument("--smoke", action="store_true",
                    help="check this script on a CPU: a tiny model, the same flow and files")
    ap.add_argument("--merge", type=Path,
                    help="an earlier machine start's JSON of this device: rows gain a range")
    ap.add_argument("--fold", type=Path,
                    help="no rows run: add this file's rows (bench/dpo_gpu.py's --out-json, "
                    "measured on the same machine start) to --merge's record, in place")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing, trace our rows' steps after the warm-up "
                    "(logging.profiler; for HF/TRL through a Trainer callback) and "
                    "print each one's ops table by self CUDA time")
    args = ap.parse_args()
    args.device = "cuda"
    # read once: the record written after each row may replace this very file
    args.earlier = json.loads(args.merge.read_text()) if args.merge else None
    if args.fold:
        if args.earlier is None:
            raise SystemExit("bench/gpu.py: --fold adds rows to a record: name it with --merge")
        add_rows(args.earlier["results"], json.loads(args.fold.read_text())["rows"],
                 args.earlier["starts"])
        args.merge.write_text(json.dumps(args.earlier, indent=2))
        print(table(args.earlier))
        return
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench/gpu.py: no CUDA device here; run it on a GPU machine "
                         "(bench/suite.py is the CPU benchmark; --smoke checks this script)")
    if args.smoke:  # the flow on a CPU with a tiny model: no number of it means anything
        args.device = "cpu"
    started = time.perf_counter()
    chosen = [r.strip() for r in args.rows.split(";") if r.strip()] or DEFAULT_ROWS
    unknown = [r for r in chosen if r not in ROWS]
    if unknown:
        raise SystemExit(f"bench/gpu.py: unknown rows {unknown}; rows: {list(ROWS)}")
    device = "cpu smoke" if args.smoke else torch.cuda.get_device_name()
    peak = 1.0 if args.smoke else matmul_ceiling()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"  # one folder per shape the chosen rows train
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    params = {shape: build_model(args.data / "tokenizer", model / shape,
                                 {**SHAPE, **shapes[shape]} if args.smoke else shapes[shape])
              for shape in dict.fromkeys(ROWS[r].get("shape", "0.41B") for r in chosen)}
    n_params = params.get("0.41B") or next(iter(params.values()))
    if not args.smoke:
        torch.cuda.empty_cache()
    alpaca = args.data / "alpaca-train"
    steps = WARMUP + 3 * args.window
    long = long_rows(alpaca, args.work / "long-rows", 8 * steps)
    grouped = grouped_split(alpaca, args.work / "alpaca-grouped", args.batch, steps)
    results: dict[str, dict] = {}
    traced_rows: dict[str, Path] = {}
    for name in chosen:
        spec = ROWS[name]
        if time.perf_counter() - started > args.budget:
            results[name] = {"error": "skipped: --budget spent"}
            continue
        work = args.work / name.replace(" ", "_").replace(",", "").replace("(", "").replace(
            ")", "").replace("+", "p")
        work.mkdir(parents=True, exist_ok=True)
        train = {"rows": long, "packed": alpaca}.get(spec.get("long"), grouped)
        t0 = time.perf_counter()
        runner = run_ours if spec["kind"] == "ours" else run_hf
        r = results[name] = runner(name, spec, args, model, train, work)
        if "ops_table" in r:
            print(f"{name}: trace {r['trace']}\n{r['ops_table']}", flush=True)
            traced_rows[name] = Path(r["trace"])
            summarise_traces(traced_rows, args.out)  # after every row: a cut call keeps it
            continue
        if "windows" in r:
            r["tokens_per_s"] = statistics.median(r["windows"])
            r["params"] = params[spec.get("shape", "0.41B")]
            r["mfu"] = (spec.get("flops_per_param", 6) * r["params"] * r["tokens_per_s"]
                        / (peak * 1e12))
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        shown = (f"{r['tokens_per_s']:,.0f} useful tok/s (windows "
                 f"{', '.join(f'{w:,.0f}' for w in r['windows'])}), final loss "
                 f"{r['final_loss']:.5f}" if "windows" in r else r["error"][-600:])
        print(f"{name}: {r['wall_s']:.0f} s, {shown}", flush=True)
        if not args.profile:  # what is measured survives a call cut short
            record = save(args, device, n_params, peak, results)
    if args.profile:
        return
    record = save(args, device, n_params, peak, results)
    print(f"\n{device}, torch {torch.__version__}; {n_params / 1e6:.0f}M params, batch "
          f"{args.batch} (long rows: their own), {WARMUP} warm-up steps then 3 windows of "
          f"{args.window}; median window; bf16 peak {peak:.0f} TFLOP/s; total "
          f"{time.perf_counter() - started:.0f} s; machine starts: {record['starts']}\n")
    print(table(record))


if __name__ == "__main__":
    main()
