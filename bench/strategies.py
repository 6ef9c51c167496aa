"""Strategy table: the default task under single, DDP, FSDP2 and DiLoCo (H = 10, 50).

Every strategy trains the default model on the default data with the same examples per optimizer
step (single: 1 x batch 8; the others: 2 ranks x batch 4) for the same number of steps, so the
tokens seen are equal; then the evaluate stage measures the loss on the whole test split.
Prints a markdown table and writes bench/results/strategies-<device>.json.

    python bench/strategies.py            # the default task (150 steps), ~6 min on 2 cores
    python bench/strategies.py --steps 50    # quicker; DiLoCo H=50 then has one outer loop
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from workdir import (ROOT, copy_project, machine, markdown_table, read_json, set_params, stage,
                     train_metrics)

TWO = {"distributed.nproc_per_node": 2, "training.per_device_train_batch_size": 4}


def runs(steps: int, outer: dict) -> list[tuple[str, dict]]:
    quiet = {"checkpoint.save_strategy": "no", "eval.eval_strategy": "no",
             "logging.logging_steps": 10}
    out = [("single", {**quiet}),
           ("ddp", {**quiet, **TWO, "distributed.strategy": "ddp"}),
           ("fsdp2", {**quiet, **TWO, "distributed.strategy": "fsdp2"})]
    for h in (10, 50):
        if steps % h == 0:
            out.append((f"diloco H={h}", {
                **quiet, **TWO, "distributed.strategy": "diloco", "training.max_steps": steps,
                "distributed.diloco.inner_steps": h, "distributed.diloco.diloco_loops": steps // h,
                **outer}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per strategy")
    ap.add_argument("--keep", action="store_true", help="keep the temp projects")
    ap.add_argument("--only", nargs="*", help="strategy labels to run (default: all)")
    ap.add_argument("--outer-lr", type=float, help="DiLoCo outer lr (default: the schema's)")
    ap.add_argument("--outer-momentum", type=float, help="DiLoCo outer momentum")
    ap.add_argument("--out", default="strategies", help="results file stem under bench/results")
    ap.add_argument("--generation-samples", type=int,
                    help="eval.max_generation_samples of each row's evaluate stage (default: the "
                         "params' own, 48 greedy generations; the suite's --quick sets 2)")
    args = ap.parse_args()
    outer = {}
    if args.outer_lr is not None:
        outer["distributed.diloco.outer_lr"] = args.outer_lr
    if args.outer_momentum is not None:
        outer["distributed.diloco.outer_momentum"] = args.outer_momentum
    work = Path(tempfile.mkdtemp(prefix="bench-strategies-"))
    base = copy_project(work / "base")
    params = {"training.max_steps": args.steps}
    if args.generation_samples is not None:
        params["eval.max_generation_samples"] = args.generation_samples
    set_params(base, params)
    for name in ("download", "format", "tokenize"):
        stage(base, name)
    rows = []
    for label, overrides in runs(args.steps, outer):
        if args.only and label not in args.only:
            continue
        project = work / label.replace(" ", "").replace("=", "")
        shutil.copytree(base, project, symlinks=True)
        set_params(project, overrides)
        wall = stage(project, "train")
        stage(project, "evaluate")
        t, e = train_metrics(project), read_json(project, "data/metrics/eval.json")
        rows.append({
            "strategy": label,
            "world": t["world_size"],
            "steps": t["global_step"],
            "tokens": t["num_input_tokens_seen"],
            "tokens/s": t["num_input_tokens_seen"] / t["train_runtime"],
            "bytes/step": t["comm_bytes_per_step"],
            "train wall s": wall,
            "eval loss": e["finetuned"]["loss"],
        })
        print(f"{label}: {rows[-1]}", flush=True)
    ddp_loss = next((r["eval loss"] for r in rows if r["strategy"] in ("ddp", "single")), None)
    for r in rows:
        r["eval gap vs ddp"] = (r["eval loss"] - ddp_loss) / ddp_loss if ddp_loss else None
    info = machine()
    cols = ["strategy", "world", "steps", "tokens", "tokens/s", "bytes/step", "train wall s",
            "eval loss", "eval gap vs ddp"]
    table = markdown_table(rows, cols)
    print(f"\n{info}\n\n{table}")
    out = ROOT / "bench/results" / f"{args.out}-{'cpu' if info['device'] == 'cpu' else 'gpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "steps": args.steps, "outer": outer,
                               "rows": rows, "table": table}, indent=2))
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
