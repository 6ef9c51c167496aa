"""Our train stage against each peer at its best correct CPU setting, in one run.

    .venv/bin/python bench/peers_cpu.py [--rows full,lora] [--steps 20] [--lora-steps 20]
                                        [--profile]

A user who knows HF compares with its best setting, not its default, so every peer runs at
the settings that make it fastest here while still training each example on its own:

- `HF Trainer` with dynamic padding (`DataCollatorForSeq2Seq`), its plain setting;
- `HF Trainer group_by_length` (`train_sampling_strategy="group_by_length"`, its own answer
  to padding: batches of similar lengths; here its sampler's batches, see below);
- `TRL SFTTrainer padding_free` (each batch one row without padding; transformers keeps the
  examples apart through the restarting `position_ids`, which the final loss checks);

in fp32 and, except plain HF, in bf16 autocast (`bf16=True`: a CPU with AVX512-BF16 or AMX
multiplies bf16 several times faster than fp32, so there it is the peers' best precision),
and for LoRA also with the frozen base loaded in bf16 (peft's usual speed setting); all with
fused AdamW, sdpa attention, batch 8, Alpaca rows of at most 512 GPT-2 tokens,
completion-only labels. The fastest of these is the best peer. `ours padfree` is our train
stage with `training.padding_free` and `training.cpu_numerics: native` (ATen's kernels for
this CPU, as the peers run; the default, portable, trades speed for the same bytes on every
x86-64 CPU), with its defaults `training.cpu_malloc_reuse` (finetune/host_memory.py) and
`training.fused_lora`, at each peer setting: fp32, bf16 autocast, and for LoRA the base in
bf16 (`model.dtype: bfloat16`); the headline ratio divides ours at the best peer's setting by
the best peer (and `ratio_vs_best_fp32_peer_both_fp32` keeps the fp32 comparison). Lever rows
at that setting show what our settings are worth: ours with
glibc's malloc defaults, ours with peft's LoRA forward, and the best peer given our malloc
environment (not an HF setting, so not a candidate for "best peer": the ratio to it is what
is ours beyond the allocator).

Two models, random weights (speed does not depend on them):

- `llama-29M`: bench/throughput.py's llama-20M shape with one decoder layer and the GPT-2
  vocabulary (28.9M parameters, tied embeddings), full fine-tuning;
- `smollm2-135M-shape`: SmolLM2-135M's shape (hidden 576, FFN 1536, 30 layers, 9 heads, 3
  KV heads, tied embeddings) with the GPT-2 vocabulary (50,257 tokens for SmolLM2's 49,152:
  135.2M parameters), LoRA r 16, alpha 32 on the attention and MLP projections (peft on the
  peers' side).

Every trainer sees the same examples: `steps` batches of HF group_by_length's first
mega-batch over the whole train split (see grouped_sample: what its sampler makes in a real
run, not the tiny mega-batches it would sort out of a short run's rows). Ours, HF
group_by_length and TRL train on exactly those batches in the same sequence, so their losses
must agree (the correctness check); plain HF reads the same rows in random batches (its
default sampler's padding), so its losses differ by the order. Each trained model (or
adapter) is also saved and scored here with one function on the first 64 test rows.
Useful tokens/s counts non-pad tokens after the first WARMUP_STEPS steps, over the time
from the end of that step to the end of the run (HF: synchronised step ends from a callback,
bench/hf_trainer.py's `warmup_window`; ours: `training.speed_metrics_start_step`); the
whole-run rate (train runtime, first steps included) is kept beside it.

`--profile` also runs our stage once more per model (at the best peer's precision) with
`logging.profiler` (torch.profiler, steps 4-5) and keeps the ops table sorted by self CPU time
in bench/results/, and the best peer once more with the same profiler on the same rows'
steps 4-5 (`profile-<model>-peer-cpu.txt`): equal batches, so the two tables compare op by op.

Writes bench/results/peers-cpu.json (`--out` changes the stem).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from memory_levers import build_gpt2_vocab_model

from finetune.host_memory import MALLOC_REUSE_ENV
from same_batches import hf_grouped_batches, read_in_our_order
from throughput import COMMON, MODELS, prepare_data, run_hf, run_ours
from workdir import ROOT, SHARED, copy_project, machine, markdown_table, set_params

HELD_OUT_ROWS = 64
#: name -> (config overrides over stories260K's, LoRA or full fine-tuning)
SHAPES = {
    "llama-29M": ({**MODELS["llama-20M"], "num_hidden_layers": 1}, False),
    "smollm2-135M-shape": ({"hidden_size": 576, "intermediate_size": 1536,
                            "num_hidden_layers": 30, "num_attention_heads": 9,
                            "num_key_value_heads": 3, "rope_theta": 100000.0}, True),
}
ROWS = {"full": "llama-29M", "lora": "smollm2-135M-shape"}
LORA = {"r": 16, "lora_alpha": 32,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}
@dataclass(frozen=True)
class Peer:
    """A peer row: bench/hf_trainer.py's spec additions, its precision (bf16: TrainingArguments'
    `bf16=True`, autocast), environment, whether it reads the rows in random batches rather
    than in group_by_length's, and whether it is a LoRA setting only."""

    options: dict
    precision: str = "fp32"
    env: dict = field(default_factory=dict)
    random_batches: bool = False
    lora_only: bool = False


PEERS = {
    "HF Trainer": Peer({}, random_batches=True),
    "HF Trainer group_by_length": Peer({}),
    "HF Trainer group_by_length, bf16 autocast": Peer({}, "bf16"),
    # peft's usual setting when speed or memory counts: the frozen base in bf16
    "HF Trainer group_by_length, bf16 base weights + bf16 autocast": Peer(
        {"base_bf16": True}, "bf16", lora_only=True),
    "TRL SFTTrainer padding_free": Peer({"trainer": "trl"}),
    "TRL SFTTrainer padding_free, bf16 autocast": Peer({"trainer": "trl"}, "bf16"),
}
#: not an HF setting: the best peer row again with our allocator settings, so that the ratio
#: to it shows what is ours beyond them (never a candidate for "best peer")
WITH_OUR_MALLOC = " + our malloc env"
SEED = 42
#: steps left out of the timed window, for every trainer: the first batch is group_by_length's
#: longest (HF puts it first), and a first step's fresh memory costs more than a whole later
#: step (a 20 s first step of 43 s measured on the LoRA row); users' runs are hundreds of steps
WARMUP_STEPS = 2
#: our rows at each peer setting: (precision, base weights in bf16) -> (name, params)
OURS_AT = {
    ("fp32", False): ("ours padfree", {}),
    ("bf16", False): ("ours padfree, bf16 autocast", {}),
    # LoRA only, as on the peers' side: the frozen base loaded in bf16 (model.dtype)
    ("bf16", True): ("ours padfree, bf16 base weights + bf16 autocast",
                     {"model.dtype": "bfloat16"}),
}
#: lever rows, run at the best peer's setting: name suffix -> (params, LoRA rows only)
LEVERS = {"glibc malloc defaults": ({"training.cpu_malloc_reuse": False}, False),
          # what training.fused_lora is worth (peft's own layer forward)
          "peft's LoRA forward": ({"training.fused_lora": False}, True)}


def setting(p: Peer) -> tuple[str, bool]:
    """A peer's (precision, base weights in bf16): the key of our row at its setting."""
    return p.precision, bool(p.options.get("base_bf16"))


def build(name: str, dest: Path) -> Path:
    """A randomly initialised Llama of the named shape with the GPT-2 tokenizer (seed 0)."""
    return build_gpt2_vocab_model(dest, SHAPES[name][0], max_positions=2048)


def grouped_sample(train_split: Path, batch: int, steps: int) -> list[int]:
    """Replace the train split with the rows of `steps` of the batches HF's group_by_length
    makes over it, laid out so that our train stage's seeded order reads them in exactly
    those batches; returns that order (for the trainers that read the split in it).

    HF's LengthGroupedSampler cuts a random permutation into mega-batches of 50 batches (fewer
    when the data is small: len // (4 x batch)), sorts each by length and cuts it into
    batches. Given only a short run's rows it would sort tiny mega-batches (40 rows for 160:
    15% padding here instead of 4% over an epoch of 1,800 rows), so its speed would be
    under-read. So the batches come from HF's own function over the whole split (seed 42):
    `steps` of the first mega-batch's 50, drawn at random (an unbiased sample of its batch
    lengths), in HF's sequence. Ours, HF group_by_length and TRL then train on the same
    batches in the same sequence (equal losses are the correctness check); plain HF reads the
    same rows in random batches, as its default sampler would."""
    import datasets
    import torch

    lengths = [len(ids) for ids in datasets.load_from_disk(str(train_split))["input_ids"]]
    per_mega = min(len(lengths) // (batch * 4), 50)
    batches = hf_grouped_batches(lengths, batch, SEED)[:per_mega]
    if steps > len(batches):
        raise SystemExit(f"{steps} steps exceed one mega-batch ({len(batches)} batches)")
    keep = sorted(torch.randperm(len(batches),
                                 generator=torch.Generator().manual_seed(SEED))[:steps].tolist())
    sequence = [i for b in keep for i in batches[b]]  # HF's rows, in its order
    return read_in_our_order(train_split, sequence, batch, steps, SEED)


def held_out_loss(model_dir: Path, trained: Path, test_split: Path) -> float:
    """Token-mean completion loss of the first HELD_OUT_ROWS test rows, padded batches of 8
    (the evaluate stage's engine.evaluation.heldout.evaluate_loss): the same function for
    every trainer's saved model or adapter."""
    import datasets
    from transformers import AutoModelForCausalLM

    from engine.evaluation.heldout import evaluate_loss

    if (trained / "adapter_config.json").exists():
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                          trained)
    else:
        model = AutoModelForCausalLM.from_pretrained(trained)
    rows = datasets.load_from_disk(str(test_split))
    rows = rows.select(range(min(HELD_OUT_ROWS, len(rows))))
    return evaluate_loss(model, rows, batch_size=8, pad_id=0)["loss"]


def profile_ours(project: Path, model_dir: Path, steps: int, lora: bool, precision: str,
                 params: dict, dest: Path) -> str:
    """Our stage once more (at `precision`, with `params`) with torch.profiler on steps 4-5;
    the ops table's path."""
    prof = project / "bench-profile"
    shutil.rmtree(prof, ignore_errors=True)
    run_ours(project, model_dir, precision, max(steps, 5), "padfree", {
        **ours_params(lora), **params,
        "logging.profiler": {"enabled": True, "wait_steps": 2, "warmup_steps": 1,
                             "active_steps": 2, "row_limit": 40, "output_dir": str(prof)}})
    shutil.copy2(next(prof.glob("ops-*.txt")), dest)
    return str(dest.relative_to(ROOT))


def profile_peer(project: Path, model_dir: Path, peer: str, order: list[int], lora: bool,
                 dest: Path) -> str:
    """The named peer once more with the same profiler (our engine's StepProfiler, through
    bench/hf_trainer.py's `profile`) on the same steps 4-5 of the same rows, so its ops table
    and ours compare op by op on equal batches; the table's path."""
    prof = project / "bench-profile-peer"
    shutil.rmtree(prof, ignore_errors=True)
    p = PEERS[peer]
    steps, batch = 5, COMMON["training.per_device_train_batch_size"]
    run_hf(project, model_dir, p.precision, steps, order[:steps * batch],
           {**p.options, "profile": {"out_dir": str(prof), "wait": 2, "active": 2},
            **({"peft": LORA} if lora else {})}, p.env)
    shutil.copy2(next(prof.glob("ops-*.txt")), dest)
    return str(dest.relative_to(ROOT))


def ours_params(lora: bool) -> dict:
    """Our stage's settings over throughput.COMMON for this row."""
    peft = ({"peft.use_peft": True, "peft.r": LORA["r"], "peft.lora_alpha": LORA["lora_alpha"],
             "peft.lora_dropout": 0.0, "peft.target_modules": LORA["target_modules"]}
            if lora else {"peft.use_peft": False})
    # native: ATen's own kernels for this CPU, what HF runs with (the default, portable, caps
    # them at AVX2 for bitwise-equal runs on any x86-64 CPU: 0.73x, docs/tracking.md)
    return {**peft, "training.cpu_numerics": "native",
            "training.speed_metrics_start_step": WARMUP_STEPS,
            # the levers and settings rows change, back (params persist between rows)
            "training.cpu_malloc_reuse": True, "training.fused_lora": True,
            "model.dtype": "float32",
            "logging.profiler": {"enabled": False}}


def measure(project: Path, tmp: Path, name: str, steps: int, profile: bool,
            results: Path) -> dict:
    import torch

    lora = SHAPES[name][1]
    model_dir = build(name, tmp / name)
    set_params(project, {"model.name_or_path": str(model_dir)})
    train_split = prepare_data(project, "alpaca", 512)
    test_split = train_split.parent / "test"
    batch = COMMON["training.per_device_train_batch_size"]
    order = grouped_sample(train_split, batch, steps)
    n_rows = len(order)
    # another seed than our order's (ours is torch.randperm with SEED: the same permutation)
    shuffled = torch.randperm(n_rows, generator=torch.Generator().manual_seed(SEED + 1)).tolist()
    row = {"model": name, "adapter": "LoRA r16 attention+MLP" if lora else "full",
           "steps": steps, "peers": {}, "precision": {}, "setting": {}}

    def peer_row(label: str, p: Peer) -> None:
        saved = tmp / f"{name}-{len(row['peers'])}"
        extra = {**p.options, "save_dir": str(saved), "warmup_window": WARMUP_STEPS,
                 **({"peft": LORA} if lora else {})}
        r = run_hf(project, model_dir, p.precision, steps,
                   shuffled if p.random_batches else order, extra, p.env)
        r["held_out_loss"] = held_out_loss(model_dir, saved, test_split)
        row["peers"][label], row["precision"][label] = r, p.precision
        row["setting"][label] = setting(p)
        say(name, label, r)

    for peer, p in PEERS.items():
        if lora or not p.lora_only:
            peer_row(peer, p)
    best = max(row["peers"], key=lambda p: row["peers"][p]["window_tokens_per_s"])
    best_at = setting(PEERS[best])
    malloc_row = best + WITH_OUR_MALLOC
    peer_row(malloc_row, Peer(PEERS[best].options, best_at[0], MALLOC_REUSE_ENV,
                              PEERS[best].random_batches))
    row["ours"] = {}

    def ours_row(label: str, at: tuple[str, bool], params: dict) -> None:
        r = run_ours(project, model_dir, at[0], steps, "padfree",
                     {**ours_params(lora), **params})
        r["held_out_loss"] = held_out_loss(model_dir, project / "data/trained", test_split)
        row["ours"][label], row["precision"][label], row["setting"][label] = r, at[0], at
        say(name, label, r)

    for at, (label, params) in OURS_AT.items():
        if lora or not at[1]:
            ours_row(label, at, params)
    headline, headline_params = OURS_AT[best_at]
    for lever, (params, lora_only) in LEVERS.items():
        if lora or not lora_only:
            ours_row(f"{headline}, {lever}", best_at, {**headline_params, **params})
    ours = row["ours"][headline]
    row["rows"] = n_rows
    row["best_peer"], row["ours_headline"] = best, headline
    best_fp32 = max((p for p in row["peers"] if row["precision"][p] == "fp32"
                     and not p.endswith(WITH_OUR_MALLOC)),
                    key=lambda p: row["peers"][p]["window_tokens_per_s"])
    row["best_fp32_peer"] = best_fp32
    for key, mine, peer in (("best_peer", headline, best), ("plain_hf", headline, "HF Trainer"),
                            ("best_peer_with_our_malloc_env", headline, malloc_row),
                            ("best_fp32_peer_both_fp32", "ours padfree", best_fp32)):
        row[f"ratio_vs_{key}"] = (row["ours"][mine]["window_tokens_per_s"]
                                  / row["peers"][peer]["window_tokens_per_s"])
        row[f"whole_run_ratio_vs_{key}"] = (row["ours"][mine]["tokens_per_s"]
                                            / row["peers"][peer]["tokens_per_s"])
    for loss in ("held_out_loss", "final_loss"):  # the same batches: must agree
        row[f"{loss}_diff_vs_best_peer"] = ours[loss] / row["peers"][best][loss] - 1
    if profile:
        row["profile"] = profile_ours(project, model_dir, steps, lora, best_at[0],
                                      headline_params, results / f"profile-{name}-cpu.txt")
        if not PEERS[best].random_batches:  # a peer on our batches: the same rows at 4-5
            row["best_peer_profile"] = profile_peer(
                project, model_dir, best, order, lora, results / f"profile-{name}-peer-cpu.txt")
    return row


def say(model: str, trainer: str, r: dict) -> None:
    print(f"  {model}: {trainer}: {r['window_tokens_per_s']:,.0f} tok/s after step "
          f"{WARMUP_STEPS} ({r['tokens_per_s']:,.0f} whole run), held-out "
          f"{r['held_out_loss']:.4f}, last train loss {r['final_loss']:.4f}", flush=True)


def table(rows: list[dict]) -> str:
    """One line per trainer row; "ours / this" divides our row at the same setting (precision
    and base weights' dtype; our lever rows: the best peer's) by this row."""
    lines = []
    for row in rows:
        entries = [{"trainer": t, **r} for t, r in {**row["peers"], **row["ours"]}.items()]
        for e in entries:
            precision = row["precision"][e["trainer"]]
            mine = OURS_AT[tuple(row["setting"][e["trainer"]])][0]
            ours = row["ours"][mine]["window_tokens_per_s"]
            lines.append({
                "model": row["model"], "adapter": row["adapter"], "trainer": e["trainer"]
                + (" (best peer)" if e["trainer"] == row["best_peer"] else ""),
                "precision": precision,
                f"useful tok/s after step {WARMUP_STEPS}": e["window_tokens_per_s"],
                "ours / this": ours / e["window_tokens_per_s"],
                "whole-run tok/s": e["tokens_per_s"],
                "padding": e["padding_fraction"], "last train loss": e["final_loss"],
                "held-out loss": e["held_out_loss"], "peak RSS MB": e["peak_rss_mb"]})
    return markdown_table(lines, list(lines[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="full,lora", help="comma list of: " + ", ".join(ROWS))
    ap.add_argument("--steps", type=int, default=20, help="steps of the full fine-tuning row")
    ap.add_argument("--lora-steps", type=int, default=20, help="steps of the LoRA row")
    ap.add_argument("--profile", action="store_true", help="also profile our step per model")
    ap.add_argument("--out", default="peers")
    ap.add_argument("--workdir", help="keep the projects here (default: a temporary folder)")
    args = ap.parse_args()
    for needed in (SHARED / "data/alpaca_2k.json", SHARED / "models/gpt2-tokenizer/tokenizer.json"):
        if not needed.is_file():  # before any work: one line, exit 2
            print(f"error: {needed} not found, needed by bench/peers_cpu.py (FINETUNE_BENCH_DATA "
                  "names the folder that holds data/ and models/)", file=sys.stderr)
            raise SystemExit(2)
    results = ROOT / "bench/results"
    rows = []
    started, load = time.time(), os.getloadavg()
    with (contextlib.nullcontext(args.workdir) if args.workdir
          else tempfile.TemporaryDirectory(prefix="bench-peers-")) as tmp:
        tmp = Path(tmp)
        project = copy_project(tmp / "p")
        for key in args.rows.split(","):
            steps = args.lora_steps if SHAPES[ROWS[key]][1] else args.steps
            rows.append(measure(project, tmp, ROWS[key], steps, args.profile, results))
    print(table(rows))
    out = results / f"{args.out}-{machine()['device']}.json"
    out.write_text(json.dumps({"machine": machine(), "load_average_before": load,
                               "wall_s": time.time() - started, "rows": rows}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
