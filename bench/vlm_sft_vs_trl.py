"""SFT of a vision-language model, ours against TRL 1.16's SFTTrainer, on the CPU: the same
model (the shipped tiny LLaVA, data/models/tiny-llava), the same rows (data/source/shapes,
params/vlm-shapes.yaml), the same trained tokens and the same frozen vision tower.

    python bench/vlm_sft_vs_trl.py --steps 200 --rounds 3

Ours: the params file's stages in a throwaway copy of the project (bench/workdir.py), the train
stage timed by its own `train_runtime` (data/logs/train_timings.json: first step to last, the
same span TRL's `train_runtime` covers), and the one-time data stages (download, format,
tokenize: the images decoded and their pixel values stored, once for every run DVC caches)
timed apart. TRL: SFTTrainer on the raw rows with PIL images, its vision collator encoding each
batch (images processed every step), `assistant_only_loss` with TRL's `{% generation %}`
markers around what ours trains (tests/test_vision_trl.py shows the batches are equal), the
vision tower frozen as ours freezes it (model.freeze_vision_tower), fp32, AdamW at the same
learning rate and cosine schedule, batch 8, no evaluation, no checkpoints. Each side runs in
its own process, one after the other; the round with the least wall time of each side counts,
and every round is in the JSON.

Writes bench/results/vlm-sft-vs-trl-tiny-llava-cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))
RESULT = ROOT / "bench/results/vlm-sft-vs-trl-tiny-llava-cpu.json"


def settings(steps: int) -> dict:
    return {"training.max_steps": steps, "checkpoint.save_strategy": "no",
            "eval.eval_strategy": "no", "logging.logging_steps": steps,
            "registry.register_model": False}


def run_ours(steps: int, work: Path) -> dict:
    """The example's stages in a copy of the project: the data stages' and the train stage's
    seconds, and the train stage's own timing."""
    from workdir import BIN, copy_project

    project = copy_project(work / "ours")
    sets = [a for k, v in settings(steps).items() for a in ("-s", f"{k}={json.dumps(v)}")]
    resolved = subprocess.run([str(BIN / "finetune"), "config", "-p", "params/vlm-shapes.yaml",
                               *sets], cwd=project, check=True, capture_output=True,
                              text=True).stdout
    (project / "params/default.yaml").write_text(resolved)
    seconds = {}
    for name in ("download", "format", "tokenize", "train"):
        started = time.perf_counter()
        subprocess.run([str(BIN / "finetune"), "stage", name], cwd=project, check=True,
                       capture_output=True, text=True)
        seconds[name] = time.perf_counter() - started
    timings = json.loads((project / "data/logs/train_timings.json").read_text())
    metrics = json.loads((project / "data/metrics/train.json").read_text())
    return {"train_runtime": timings["train_runtime"], "steps": metrics["global_step"],
            "tokens": metrics["num_input_tokens_seen"], "train_loss": metrics["train_loss"],
            "stage_seconds": seconds}


def run_trl(steps: int, work: Path) -> dict:
    import datasets
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    from engine.kinds.image_text_to_text import part_of
    from engine.modeling.model import choose_pad_token

    model_dir = ROOT / "data/models/tiny-llava"
    source = ROOT / "data/source/shapes"
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.pad_token = choose_pad_token(processor.tokenizer)
    from preprocess.vlm_shapes import MARKED_TEMPLATE

    processor.chat_template = MARKED_TEMPLATE
    rows = []
    for line in (source / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.append({"messages": r["messages"],
                     "images": [Image.open(source / p).convert("RGB") for p in r["images"]]})
    torch.manual_seed(42)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    for name, param in model.named_parameters():  # model.freeze_vision_tower, as ours
        if part_of(name) == "vision":
            param.requires_grad_(False)
    args = SFTConfig(output_dir=str(work / "trl"), use_cpu=True, bf16=False, report_to=[],
                     max_steps=steps, per_device_train_batch_size=8, learning_rate=0.003,
                     lr_scheduler_type="cosine", warmup_steps=4, weight_decay=0.0,
                     max_grad_norm=1.0, logging_steps=steps, save_strategy="no",
                     max_length=None, assistant_only_loss=True, seed=42,
                     dataloader_drop_last=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=processor,
                         train_dataset=datasets.Dataset.from_list(rows))
    out = trainer.train()
    tokens = trainer.state.num_input_tokens_seen or None
    return {"train_runtime": out.metrics["train_runtime"], "steps": trainer.state.global_step,
            "tokens": tokens, "train_loss": out.metrics["train_loss"]}


def worker(side: str, steps: int, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = (run_ours if side == "ours" else run_trl)(steps, Path(tmp))
    out.write_text(json.dumps(result))


def launch(side: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        started = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--side", side, "--steps", str(steps),
                        "--out", str(out)], check=True, cwd=ROOT,
                       env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
        result = json.loads(out.read_text())
        result["wall"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        worker(args.side, args.steps, args.out)
        return
    import torch

    runs = {"ours": [], "trl": []}
    for _ in range(args.rounds):
        for side in ("ours", "trl"):
            runs[side].append(launch(side, args.steps))
    best = {side: min(r, key=lambda x: x["train_runtime"]) for side, r in runs.items()}
    per_step = {side: b["train_runtime"] / b["steps"] for side, b in best.items()}
    ratio = per_step["trl"] / per_step["ours"]
    cpu = platform.processor() or "cpu"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line)
    except (OSError, StopIteration):
        pass
    result = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()},
              "model": "data/models/tiny-llava", "rows": "data/source/shapes/train.jsonl",
              "steps": args.steps, "batch": 8, "rounds": runs,
              "seconds_per_step": per_step, "ratio_trl_over_ours": ratio,
              "our_data_stages_seconds": {k: v for k, v in best["ours"]["stage_seconds"].items()
                                          if k != "train"}}
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print("| side | s/step (best round) | train_loss | rounds (train_runtime s) |")
    print("|---|---|---|---|")
    for side in ("ours", "trl"):
        rounds = ", ".join(f"{r['train_runtime']:.2f}" for r in runs[side])
        print(f"| {side} | {per_step[side]:.4f} | {best[side]['train_loss']:.4f} | {rounds} |")
    print(f"TRL / ours: {ratio:.2f}x; ours' one-time data stages: "
          f"{result['our_data_stages_seconds']}")


if __name__ == "__main__":
    main()
