"""The GRPO family on the shipped example (params/grpo-gsm8k.yaml): each loss type, GSPO's
sequence-level ratio, dynamic sampling, RLOO, and the example with its rollouts from an
OpenAI-compatible server over HTTP (`grpo.use_vllm`) trained for the same steps from the same
SFT model, with the evaluate stage's held-out numbers (sampled and greedy rewards, pass@k), the
reward and vLLM-mismatch statistics at each logged step, and the train stage's time. A
quality ablation, not a speed target: the table in docs/training.md comes from here.

    .venv/bin/python bench/grpo_ablation.py [--steps 80] [--only dapo,rloo]

Runs in a throwaway copy of the project (bench/workdir.py): the default run once (what `make
sft-base` keeps as data/sft/gsm8k), then per variant the example's train and evaluate stages.
Writes bench/results/grpo-ablation-stories260K-cpu.json."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workdir import (BIN, ROOT, copy_project, machine, markdown_table,  # noqa: E402
                     read_json, set_params, stage)

STAGES = ("download", "format", "tokenize", "train", "evaluate", "export")
#: variant -> overrides of the example (its own: loss_type dapo, beta 0, 8 completions)
VARIANTS = {
    "dapo (example)": {},
    "grpo": {"grpo.loss_type": "grpo"},
    "dr_grpo": {"grpo.loss_type": "dr_grpo"},
    "bnpo": {"grpo.loss_type": "bnpo"},
    "gspo": {"grpo.loss_type": "grpo", "grpo.importance_sampling_level": "sequence"},
    "cispo": {"grpo.loss_type": "cispo", "grpo.epsilon_high": 5.0},
    "sapo": {"grpo.loss_type": "sapo"},
    "luspo": {"grpo.loss_type": "luspo", "grpo.importance_sampling_level": "sequence"},
    "vespo": {"grpo.loss_type": "vespo"},
    "dapo + dynamic sampling": {"grpo.dynamic_sampling": True},
    "rloo": "rloo",
    # the example's rollouts from an OpenAI-compatible server over HTTP (grpo.use_vllm): the
    # tests' server (tests/rollout_server.py, vLLM's endpoints over our generator), started
    # here on 127.0.0.1 over the SFT model; the adapter synced at every step
    "dapo over HTTP": "http",
}
#: per logged step of data/plots/train.csv, kept in each row so runs compare step by step
CURVES = ("reward", "sampling/sampling_logp_difference/mean",
          "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
          "sampling/importance_sampling_ratio/max")
#: the held-out numbers of the table (eval.json: base and fine-tuned)
NUMBERS = ("sampled_reward_format", "sampled_reward", "reward", "pass_at_1", "pass_at_4")


def rloo_overrides(raw: dict) -> dict:
    """The example's rollout settings under training.type rloo (beta 0, as the example's)."""
    from finetune.config.rollout import RolloutConfig

    g = raw["grpo"]
    shared = {k: g[k] for k in RolloutConfig.model_fields if k in g}
    return {"training.type": "rloo", **{f"rloo.{k}": v for k, v in shared.items()},
            "rloo.beta": 0.0}


def main() -> None:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="grpo-ablation-"))
    project = work / "p"
    if not (project / "data/sft/gsm8k").exists():
        shutil.rmtree(project, ignore_errors=True)
        project.mkdir(parents=True)
        copy_project(project)
        for name in STAGES:  # the default run: make sft-base
            stage(project, name)
        shutil.copytree(project / "data/export", project / "data/sft/gsm8k")
    resolved = subprocess.run([str(BIN / "finetune"), "config", "-p", "params/grpo-gsm8k.yaml"],
                              cwd=project, capture_output=True, text=True, check=True).stdout
    rows = []
    wanted = [v for v in args.only.split(",") if v] or list(VARIANTS)
    for name in wanted:
        (project / "params/default.yaml").write_text(resolved)
        overrides, server = VARIANTS[name], contextlib.nullcontext()
        if overrides == "rloo":
            overrides = rloo_overrides(yaml.safe_load(resolved))
        elif overrides == "http":
            sys.path.insert(0, str(ROOT / "tests"))
            from rollout_server import RolloutServer

            server = RolloutServer(project / "data/sft/gsm8k")
            overrides = {"grpo.use_vllm": True, "grpo.vllm_server_base_url": server.url}
        set_params(project, {**overrides, "training.max_steps": args.steps,
                             "checkpoint.save_strategy": "no"})
        for out in ("data/checkpoints", "data/trained"):
            shutil.rmtree(project / out, ignore_errors=True)
        for s in ("download", "format", "tokenize"):
            stage(project, s)
        started = time.perf_counter()
        with server:
            train_s = stage(project, "train")
        stage(project, "evaluate")
        ev = read_json(project, "data/metrics/eval.json")
        row = {"variant": name, "train_s": round(train_s, 1),
               "wall_s": round(time.perf_counter() - started, 1)}
        for key in NUMBERS:
            row[f"base {key}"] = ev.get("base", {}).get(key)
            row[key] = ev.get("finetuned", {}).get(key, ev.get(key))
        with open(project / "data/plots/train.csv") as fh:
            logged = list(csv.DictReader(fh))
        for key in CURVES:
            if logged and key in logged[0]:
                row[f"steps {key}"] = [float(r[key]) for r in logged if r.get(key)]
        rows.append(row)
        print(json.dumps(row), flush=True)
    columns = ["variant", *NUMBERS, "train_s"]
    out = ROOT / "bench/results/grpo-ablation-stories260K-cpu.json"
    kept = []  # an earlier invocation's rows of other variants (--only runs some)
    if out.exists():
        earlier = json.loads(out.read_text())
        if earlier.get("steps") == args.steps:
            kept = [r for r in earlier["rows"] if r["variant"] not in {x["variant"] for x in rows}]
    rows = sorted(kept + rows, key=lambda r: list(VARIANTS).index(r["variant"]))
    out.write_text(json.dumps({"machine": machine(), "steps": args.steps,
                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1)
                   + "\n")
    print(markdown_table(rows, columns))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
