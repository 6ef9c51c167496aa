"""GPU benchmark: our engine's DPO (`training.type: dpo`) against TRL's DPOTrainer on one GPU,
same model, same pairs in the same order, same pairs per step, precision, optimiser, lr, beta
and sigmoid loss, each trainer at its best correct setting, eager and compiled.

Why: bench/dpo.py prices a DPO step against an SFT step on the CPU; this is the row pair that
says whether our DPO is as fast as the trainer people would otherwise use, on the GPU.

    python bench/dpo_gpu.py prep OUT      # here (the whole stack): data for the GPU machine
    python bench/dpo_gpu.py run --data OUT [--shape 0.41B|tiny] [--pairs 16] [--window 6]
        [--warmup 10] [--device cuda|cpu] [--precision bf16|fp32] [--rows "NAME;NAME"]
        [--budget 420] [--lr 1e-5] [--out-json PATH]

`prep` runs the shipped GSM8K pairs (data/source/gsm8k-pairs/train.jsonl, 600 pairs, prompt
template "Question: {question}\\nAnswer:") through our own download, format and tokenize stages
with the GPT-2 tokenizer (a config-only Llama with max_position 2048, bench/gpu_prep.py), in a
throwaway copy of the project (bench/workdir.py), and writes OUT/pairs-train (our tokenized
preference split: input_ids/labels of the chosen side, rejected_input_ids/rejected_labels),
OUT/tokenizer, and OUT/trl-pairs-train: the same token ids in TRL's pre-tokenized layout
(prompt_ids, chosen_ids, rejected_ids, cut where our labels start; EOS included as ours trains
it), row for row. TRL 1.16's DPOTrainer has no "skip preparation" switch for text data, so the
TRL side runs a DPOTrainer whose `_prepare_dataset` returns the pre-tokenized rows as they are:
its collator, loss, reference forward and loop are TRL's own, on our exact ids.

`run` (on the GPU machine: torch, transformers, peft, and datasets/pydantic/trl carried; no
pandera, DVC, MLflow or Prefect) builds a Llama from config with torch.manual_seed(0) (0.41B:
bench/gpu.py's SHAPE; `tiny`: hidden 64, 2 layers, for the CPU check), full fine-tuning, fp32
weights under bf16 autocast, fused AdamW (--lr, default 1e-5, cosine, 2 warm-up steps, clip
1.0), DPO sigmoid loss with beta 0.1, the reference a frozen copy of the initial policy on
both sides (no precomputed reference log-probabilities on either), then the rows:
- `ours DPO`, `ours DPO + compile`: our engine under torchrun (the job bench/engine_smoke.py
  writes), padded layout (its only one for DPO: packing, padding_free and Liger are refused for
  preference runs), compile = regional per decoder block with batches padded to multiples of 64;
- `TRL DPOTrainer (cuDNN SDPA off)`, `TRL DPOTrainer + compile (cuDNN SDPA off)`: in their own
  process, the dataset in our order read sequentially, gradient_checkpointing off (DPOConfig
  turns it on by default; ours is off), compile = TrainingArguments.torch_compile with the same
  pad_to_multiple_of 64; cuDNN SDPA off as in bench/gpu.py (where it made HF's padded batches
  1.6x faster; our engine puts cuDNN last by default). TRL 1.16's padding_free warns and falls
  back to padding, so it is not a setting here. `TRL DPOTrainer + Liger (cuDNN SDPA off)` (its
  deprecated use_liger_kernel: layer kernels only) can be asked for with --rows.
Both sides read the same pairs in the same order: our trainer's seeded permutation
(engine.datapath.data.ShardedBatches, `order` here: the sampler our DPO run gets as SFT does),
and every row checks its per-step token counts against that order.

Timing: --warmup steps, then three windows of --window steps between device-synchronised marks
(bench/gpu_timer.py: WindowTimer for ours, hf_timer for TRL). Per row: the median window in
pairs/s and useful tokens/s (non-pad tokens of chosen + rejected), the windows, the loss at every
step, peak GiB (CUDA), wall seconds, and ours / the best TRL row. The first-step losses must be
log 2 (policy = reference) on both sides and the final losses agree within 1%. Prints a markdown
table and writes --out-json ({"rows": {name: {...}}, "device", "torch", ...}). `--device cuda`
without CUDA refuses in one line (exit 2). Rows not started within --budget seconds are
reported as skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import boundaries  # noqa: E402
from same_batches import our_order  # noqa: E402

PROMPT = "Question: {question}\nAnswer:"
PAIRS_FILES = {s: ROOT / f"data/source/gsm8k-pairs/{s}.jsonl" for s in ("train", "test")}
TINY = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 2048,
        "tie_word_embeddings": False}
BETA, WARMUP_LR_STEPS, PAD_COMPILE = 0.1, 2, 64

ROWS = {
    "ours DPO": {"kind": "ours", "compile": False},
    "TRL DPOTrainer (cuDNN SDPA off)": {"kind": "trl", "compile": False},
    "ours DPO + compile": {"kind": "ours", "compile": True},
    "TRL DPOTrainer + compile (cuDNN SDPA off)": {"kind": "trl", "compile": True},
    "TRL DPOTrainer + Liger (cuDNN SDPA off)": {"kind": "trl", "compile": False,
                                                "liger": True},
}
DEFAULT_ROWS = list(ROWS)[:4]


# -- prep (here, the whole stack) -------------------------------------------------------------

def trl_layout(pair: dict) -> dict:
    """One pair of our split as TRL's pre-tokenized row: the prompt is what precedes the first
    trained label (the same on both sides), each completion the trained rest."""
    out = {}
    for side, ids, labels in (("chosen", pair["input_ids"], pair["labels"]),
                              ("rejected", pair["rejected_input_ids"], pair["rejected_labels"])):
        start = next(i for i, x in enumerate(labels) if x != -100)
        if any(x == -100 for x in labels[start:]) or labels[start:] != ids[start:]:
            raise ValueError("a pair whose trained tokens are not one tail of the row")
        if out.setdefault("prompt_ids", ids[:start]) != ids[:start]:
            raise ValueError("a pair whose two sides have different prompts")
        out[f"{side}_ids"] = ids[start:]
    return out


def prep(out: Path) -> None:
    import datasets
    from gpu_prep import through_stages

    through_stages({"training.type": "dpo", "data.dataset_type": "preference",
                    "data.data_files": {k: str(v) for k, v in PAIRS_FILES.items()},
                    "data.prompt_template": PROMPT, "data.completion_template": None,
                    "data.max_seq_length": 1024, "data.max_eval_samples": 8},
                   out, "pairs-train")
    ours = datasets.load_from_disk(str(out / "pairs-train"))
    cols = ["input_ids", "labels", "rejected_input_ids", "rejected_labels"]
    rows = [trl_layout(dict(zip(cols, v))) for v in zip(*(ours[c] for c in cols))]
    datasets.Dataset.from_list(rows).save_to_disk(str(out / "trl-pairs-train"))
    sides = [len(x) for c in ("input_ids", "rejected_input_ids") for x in ours[c]]
    print(f"wrote {out}/pairs-train ({len(ours)} pairs, {sum(sides) / len(ours):.0f} tokens a "
          f"pair on average, longest side {max(sides)}), {out}/trl-pairs-train and "
          f"{out}/tokenizer")


# -- run (the GPU machine) --------------------------------------------------------------------

def run_child(cmd: list[str], log: Path, timeout: float, env: dict) -> tuple[int, str]:
    """A child in its own process group (engine_smoke.run_killable), its output in `log`."""
    from engine_smoke import run_killable

    proc = run_killable(cmd, timeout, env)
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode, failure(proc)


def failure(proc) -> str:
    """A failed child's return code (124: killed at its timeout) and the end of its output."""
    timed_out = " (timed out)" if proc.returncode == 124 else ""
    return f"rc {proc.returncode}{timed_out}: {(proc.stdout + proc.stderr)[-2500:]}"


def child_env(args) -> dict:
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(args.threads))
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_ours(spec: dict, args, model: Path, work: Path, timeout: float) -> dict:
    from engine_smoke import launch

    steps = args.warmup + 3 * args.window
    timer = work / "marks.jsonl"
    overrides = {
        "model.name_or_path": str(model), "model.attn_implementation": "sdpa",
        "model.dtype": "float32", "peft.use_peft": False,
        "training.type": "dpo", "data.dataset_type": "preference",
        "data.data_files": {k: str(v) for k, v in PAIRS_FILES.items()},
        "data.prompt_template": PROMPT, "data.completion_template": None,
        "data.max_seq_length": 1024,
        "dpo.beta": BETA, "dpo.loss_type": "sigmoid", "dpo.precompute_ref_log_probs": False,
        "training.mixed_precision": args.precision, "training.max_steps": steps,
        "training.per_device_train_batch_size": args.pairs,
        "training.gradient_accumulation_steps": 1, "training.seed": 42,
        "training.gradient_checkpointing": False, "training.max_grad_norm": 1.0,
        "optimizer.name": "AdamW", "optimizer.learning_rate": args.lr,
        "optimizer.weight_decay": 0.0, "optimizer.kwargs": {"fused": True},
        "scheduler.name": "cosine", "scheduler.warmup_steps": WARMUP_LR_STEPS,
        "checkpoint.save_strategy": "no", "eval.eval_strategy": "no",
        "logging.logging_steps": 1, "logging.report_to": [],
        "logging.callbacks": [{"class": "bench.gpu_timer:WindowTimer", "kwargs": {
            "path": str(timer), "boundaries": boundaries(args.window, args.warmup)}}]}
    if spec["compile"]:
        overrides.update({"training.torch_compile": True, "training.dynamo_recompile_limit": 32,
                          "training.pad_to_multiple_of": PAD_COMPILE})
    proc = launch(work, overrides, args.data / "pairs-train", None, timeout, child_env(args))
    if proc.returncode != 0:
        return {"error": failure(proc)}
    with open(work / "plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    seen = [0] + [int(float(r["num_input_tokens_seen"])) for r in rows
                  if r.get("num_input_tokens_seen")]
    metrics = json.loads((work / "train.json").read_text())
    return {"losses": [float(r["loss"]) for r in rows],
            "tokens_logged": [b - a for a, b in zip(seen, seen[1:])],
            "peak_gib": metrics.get("cuda_max_memory_allocated_mb", 0) / 1024,
            "compile_graphs": metrics.get("torch_compile_graphs"), "marks": str(timer)}


def run_trl(spec: dict, args, model: Path, work: Path, timeout: float, order: list[int]
            ) -> dict:
    steps = args.warmup + 3 * args.window
    timer = work / "marks.jsonl"
    job = {"train": str(args.data / "trl-pairs-train"), "model": str(model), "order": order,
           "threads": args.threads, "seed": 42, "precision": args.precision,
           "pairs": args.pairs, "steps": steps, "device": args.device, "lr": args.lr,
           "output_dir": str(work / "out"), "compile": spec["compile"],
           "liger": spec.get("liger", False), "cudnn": False,
           "timer": {"path": str(timer), "boundaries": boundaries(args.window, args.warmup)}}
    (work / "spec.json").write_text(json.dumps(job))
    rc, text = run_child([sys.executable, str(Path(__file__).resolve()), "trl",
                          str(work / "spec.json"), str(work / "result.json")],
                         work / "log.txt", timeout, child_env(args))
    if rc != 0:
        return {"error": text}
    r = json.loads((work / "result.json").read_text())
    return {"losses": r["losses"], "tokens_logged": r["tokens_per_step"],
            "peak_gib": r["cuda_peak_gib"], "marks": str(timer)}


def trl_worker(spec_path: str, out_path: str) -> None:
    """TRL's side, in its own process: DPOTrainer on the pre-tokenized pairs in our order."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    if not spec["cudnn"]:
        torch.backends.cuda.enable_cudnn_sdp(False)
    rows = datasets.load_from_disk(spec["train"]).select(spec["order"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def load():
        return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                    attn_implementation="sdpa")

    model, ref = load(), load().eval().requires_grad_(False)
    cpu = spec["device"] == "cpu"
    args = DPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["pairs"],
        gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=spec["lr"],
        weight_decay=0.0, lr_scheduler_type="cosine", warmup_steps=WARMUP_LR_STEPS,
        max_grad_norm=1.0, optim="adamw_torch_fused", bf16=spec["precision"] == "bf16",
        use_cpu=cpu, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", seed=spec["seed"], train_sampling_strategy="sequential",
        dataloader_drop_last=True, disable_tqdm=True, remove_unused_columns=False,
        gradient_checkpointing=False, beta=BETA, loss_type=["sigmoid"], max_length=None,
        precompute_ref_log_probs=False, torch_compile=spec["compile"],
        pad_to_multiple_of=PAD_COMPILE if spec["compile"] else None,
        use_liger_kernel=spec["liger"])

    class PreTokenized(DPOTrainer):
        """TRL's trainer on rows that are already prompt_ids/chosen_ids/rejected_ids."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    losses: list[float] = []
    per_step: list[int] = []
    cuda = torch.cuda.is_available() and not cpu

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_timer import hf_timer

    trainer = PreTokenized(model=model, ref_model=ref, args=args, train_dataset=rows,
                           processing_class=tok,
                           callbacks=[Record(), hf_timer(**spec["timer"])])
    collator = trainer.data_collator

    def counting(features):
        batch = collator(features)
        per_step.append(int(batch["attention_mask"].sum()))
        return batch

    trainer.data_collator = counting
    trainer.train()
    json.dump({"losses": losses, "tokens_per_step": per_step[:spec["steps"]],
               "cuda_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0},
              open(out_path, "w"))


def table(results: dict, args, header: str) -> str:
    trl = [r["pairs_per_s"] for n, r in results.items() if n.startswith("TRL") and
           "pairs_per_s" in r]
    best = max(trl) if trl else None
    lines = [header, "", "| run | pairs/s | useful tok/s | vs best TRL | windows (pairs/s) | "
             "loss step 1 | final loss | peak GiB | wall s | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "pairs_per_s" not in r:
            lines.append(f"| {name} | failed | | | | | | | | {r['error'][-300:]!r} |")
            continue
        vs = f"{r['pairs_per_s'] / best:.2f}x" if best else "-"
        lines.append(
            f"| {name} | {r['pairs_per_s']:,.2f} | {r['tokens_per_s']:,.0f} | {vs} | "
            f"{', '.join(f'{w:,.2f}' for w in r['windows'])} | {r['losses'][0]:.5f} | "
            f"{r['final_loss']:.5f} | {r['peak_gib']:.1f} | {r['wall_s']:.0f} | "
            f"{r.get('note', '')} |")
    return "\n".join(lines)


def checks(results: dict) -> dict:
    """First-step losses at log 2, final losses within 1% of each other, and the largest
    per-step loss gap of every row to the first ours row."""
    done = {n: r for n, r in results.items() if "losses" in r}
    out = {"first_step_log2": {n: abs(r["losses"][0] - math.log(2)) < 1e-3
                               for n, r in done.items()}}
    finals = [r["final_loss"] for r in done.values()]
    if finals:
        out["final_spread"] = (max(finals) - min(finals)) / abs(statistics.median(finals))
        out["final_within_1pct"] = out["final_spread"] < 0.01
    ours = next((r for n, r in done.items() if n.startswith("ours")), None)
    if ours:
        out["max_step_gap_to_ours"] = {n: max(abs(a - b) for a, b in zip(r["losses"],
                                                                         ours["losses"]))
                                       for n, r in done.items()}
    return out


def run(args) -> None:
    import datasets
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/dpo_gpu.py: --device cuda but no CUDA device here (the CPU check is "
              "--device cpu --shape tiny)", file=sys.stderr)
        raise SystemExit(2)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    chosen = [r.strip() for r in args.rows.split(";") if r.strip()] or DEFAULT_ROWS
    unknown = [r for r in chosen if r not in ROWS]
    if unknown:
        raise SystemExit(f"bench/dpo_gpu.py: unknown rows {unknown}; rows: {list(ROWS)}")
    for need in ("pairs-train", "trl-pairs-train", "tokenizer"):
        if not (args.data / need).exists():
            raise SystemExit(f"bench/dpo_gpu.py: {args.data / need} missing; "
                             "run `python bench/dpo_gpu.py prep OUT` first")
    started = time.perf_counter()
    from gpu import SHAPE, build_model

    shape = SHAPE if args.shape == "0.41B" else TINY
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "model"
    n_params = build_model(args.data / "tokenizer", model, shape)
    steps = args.warmup + 3 * args.window
    ours_ds = datasets.load_from_disk(str(args.data / "pairs-train"))
    trl_ds = datasets.load_from_disk(str(args.data / "trl-pairs-train"))
    if len(trl_ds) != len(ours_ds):
        raise SystemExit("bench/dpo_gpu.py: pairs-train and trl-pairs-train differ in length")
    seq = our_order(len(ours_ds), args.pairs, steps, 42)  # one epoch: our DPO run's order
    lengths = [len(a) + len(b) for a, b in zip(ours_ds["input_ids"],
                                                ours_ds["rejected_input_ids"])]
    tokens_per_step = [sum(lengths[i] for i in seq[s * args.pairs:(s + 1) * args.pairs])
                       for s in range(steps)]
    from gpu_timer import windows

    results: dict[str, dict] = {}
    for name in chosen:
        spec = ROWS[name]
        left = args.budget - (time.perf_counter() - started)
        if left <= 0:
            results[name] = {"error": "skipped: --budget spent"}
            print(f"{name}: skipped (--budget spent)", flush=True)
            continue
        work = args.work / name.replace(" ", "_").replace("(", "").replace(")", "").replace(
            "+", "p")
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        t0 = time.perf_counter()
        timeout = left + args.grace
        r = (run_ours(spec, args, model, work, timeout) if spec["kind"] == "ours"
             else run_trl(spec, args, model, work, timeout, seq))
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        if "error" not in r:
            marks = r.pop("marks")
            r["windows"] = windows(marks, [args.pairs] * steps)
            r["token_windows"] = windows(marks, tokens_per_step)
            r["pairs_per_s"] = statistics.median(r["windows"])
            r["tokens_per_s"] = statistics.median(r["token_windows"])
            r["final_loss"] = r["losses"][-1]
            r["same_tokens_as_order"] = r.pop("tokens_logged")[:steps] == tokens_per_step
            if len(r["losses"]) != steps:
                r["note"] = f"{len(r['losses'])} losses logged for {steps} steps"
            if not r["same_tokens_as_order"]:
                r["note"] = (r.get("note", "") + " token counts differ from the order's").strip()
            shown = (f"{r['pairs_per_s']:,.2f} pairs/s, {r['tokens_per_s']:,.0f} tok/s, loss "
                     f"{r['losses'][0]:.5f} -> {r['final_loss']:.5f}")
        else:
            shown = r["error"][-800:]
        results[name] = r
        print(f"{name}: {r['wall_s']:.0f} s, {shown}", flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() \
        or "cpu"
    header = (f"{device}, torch {torch.__version__}; {n_params / 1e6:.1f}M params ({args.shape})"
              f", {args.pairs} pairs a step, {args.precision}, {args.warmup} warm-up steps then "
              f"3 windows of {args.window}; median window; total "
              f"{time.perf_counter() - started:.0f} s")
    print("\n" + table(results, args, header))
    verdict = checks(results)
    print("\nchecks: " + json.dumps(verdict))
    for name, r in results.items():
        if "losses" in r:
            print(f"{name} losses: {' '.join(f'{x:.6f}' for x in r['losses'])}")
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps({
            "rows": results, "checks": verdict, "device": device, "torch": torch.__version__,
            "python": platform.python_version(), "params": n_params, "shape": args.shape,
            "pairs_per_step": args.pairs, "precision": args.precision,
            "warmup_steps": args.warmup, "window_steps": args.window,
            "tokens_per_step": tokens_per_step}, indent=2))
        print(f"wrote {args.out_json}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "trl":  # the TRL row's own process
        trl_worker(*sys.argv[2:4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep", help="tokenize the GSM8K pairs through our stages into OUT")
    p.add_argument("out", type=Path)
    r = sub.add_parser("run", help="the rows (on the GPU machine)")
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--shape", choices=["0.41B", "tiny"], default="0.41B")
    r.add_argument("--pairs", type=int, default=16, help="pairs per optimizer step")
    r.add_argument("--window", type=int, default=6, help="steps per timed window")
    r.add_argument("--warmup", type=int, default=10, help="steps before the first window")
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    r.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help="default: bf16 on cuda, fp32 on cpu")
    r.add_argument("--rows", default="", help=f"row names separated by ; (default: "
                   f"{';'.join(DEFAULT_ROWS)}; also: {';'.join(list(ROWS)[4:])})")
    r.add_argument("--lr", type=float, default=1e-5)
    r.add_argument("--budget", type=float, default=420.0,
                   help="seconds; rows not started by then are reported as skipped")
    r.add_argument("--grace", type=float, default=60.0,
                   help="seconds past --budget a started row may run before it is killed")
    r.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    r.add_argument("--work", type=Path, default=Path("/tmp/bench-dpo-gpu"))
    r.add_argument("--out-json", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "prep":
        prep(args.out)
    else:
        run(args)


if __name__ == "__main__":
    main()
