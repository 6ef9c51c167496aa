"""What a DPO step costs: our `training.type: dpo` step over N pairs against our SFT step over
the same 2N sequences (both sides of every pair as completion rows), measured in the same run.

The DPO step's extra work is the reference forward (no gradient) and the log-probability
bookkeeping; with `dpo.precompute_ref_log_probs` the reference runs once before training and
the step reads its pairs' values from a table. Both runs go through the train stage users run,
on the shipped GSM8K pairs, a randomly initialised Llama of the given shape (stories260K's
512-token vocabulary and tokenizer), fp32, with 1024 positions so that no pair is cut. Speed is
the train stage's own `train_steps_per_second` after `--warmup` steps.

    python bench/dpo.py                     # llama-20M, LoRA and full fine-tuning, 12 steps
    python bench/dpo.py --model llama-4M --steps 8 --peft lora

Prints a markdown table and writes bench/results/dpo-<model>-cpu.json (or -<device>).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from throughput import MODELS, build_model
from workdir import ROOT, copy_project, machine, markdown_table, set_params, stage, train_metrics

PAIRS = {split: ROOT / f"data/source/gsm8k-pairs/{split}.jsonl" for split in ("train", "test")}
PROMPT = "Question: {question}\nAnswer:"


def sft_rows(dest: Path) -> dict[str, str]:
    """Both sides of every pair as completion rows: the 2N sequences an SFT step sees."""
    files = {}
    for split, source in PAIRS.items():
        files[split] = str(dest / f"{split}.jsonl")
        with source.open() as fh, open(files[split], "w") as out:
            for line in fh:
                row = json.loads(line)
                for side in ("chosen", "rejected"):
                    out.write(json.dumps({"question": row["question"],
                                          "answer": row[side]}) + "\n")
    return files


def run(project: Path, params: dict) -> dict:
    set_params(project, params)
    for name in ("download", "format", "tokenize", "train"):
        stage(project, name)
    m = train_metrics(project)
    return {"steps_per_s": m["train_steps_per_second"], "train_loss": m["train_loss"],
            "rss_mb": m["memory_rss_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-20M", choices=[m for m in MODELS if MODELS[m]])
    parser.add_argument("--pairs", type=int, default=4, help="pairs per step (N)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peft", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = copy_project(Path(tmp) / "p")
        model_dir = build_model(args.model, Path(tmp) / "model")
        sft_files = sft_rows(Path(tmp))
        rows = args.pairs * (args.steps + 1)
        common = {"model.name_or_path": str(model_dir), "data.max_seq_length": 1024,
                  "data.max_eval_samples": 8,
                  "checkpoint.save_strategy": "no", "eval.eval_strategy": "no",
                  "registry.register_model": False, "training.max_steps": args.steps,
                  "training.speed_metrics_start_step": args.warmup, "training.seed": 42,
                  "training.per_device_eval_batch_size": 2 * args.pairs,
                  "logging.logging_steps": args.steps}
        sft = {**common, "training.type": "sft", "data.dataset_type": "completion",
               "data.data_files": sft_files,
               "data.prompt_template": PROMPT, "data.completion_template": "{answer}",
               "data.max_train_samples": 2 * rows,
               "training.per_device_train_batch_size": 2 * args.pairs}
        dpo = {**common, "training.type": "dpo", "data.dataset_type": "preference",
               "data.data_files": {k: str(v) for k, v in PAIRS.items()},
               "data.prompt_template": PROMPT, "data.completion_template": None,
               "data.max_train_samples": rows,
               "training.per_device_train_batch_size": args.pairs}
        results = []
        for peft in args.peft:
            tuned = {"peft.use_peft": peft == "lora"}
            base = run(project, {**sft, **tuned})
            per_step = run(project, {**dpo, **tuned, "dpo.precompute_ref_log_probs": False})
            table = run(project, {**dpo, **tuned, "dpo.precompute_ref_log_probs": True})
            results.append({
                "model": args.model, "peft": peft, "pairs_per_step": args.pairs,
                "sft_steps_per_s": base["steps_per_s"],
                "dpo_steps_per_s": per_step["steps_per_s"],
                "dpo_precomputed_steps_per_s": table["steps_per_s"],
                "dpo_step_vs_sft": base["steps_per_s"] / per_step["steps_per_s"],
                "dpo_precomputed_step_vs_sft": base["steps_per_s"] / table["steps_per_s"]})
    columns = list(results[0])
    print(markdown_table(results, columns))
    info = machine()
    device = "cpu" if info["device"] == "cpu" else info["device"].lower().replace(" ", "-")
    out = ROOT / f"bench/results/dpo-{args.model}-{device}.json"
    out.write_text(json.dumps({"machine": info, "args": vars(args), "rows": results},
                              indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
