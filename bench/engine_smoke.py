"""The engine on any device, without the orchestration stack (no DVC, MLflow, Prefect, pandera):
`engine.worker` under torchrun, driven by job files, on an already tokenized split.

Checks, for a GPU machine that has torch/transformers/peft (+ datasets and pydantic carried):
the default task trains; bf16 padded, packed and padding-free layouts agree; a run resumed from
its middle checkpoint ends with the uninterrupted run's adapter, byte for byte. Prints one table.

    python bench/engine_smoke.py --tokenized data/tokenized --out /tmp/smoke [--steps 20]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.process.job import JobSpec, RunPaths  # noqa: E402
from finetune.config import load_config  # noqa: E402


def launch(work: Path, overrides: dict, train_data: Path, eval_data: Path | None,
           timeout: float | None = None, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    """One job of the default params with `overrides`, every output under `work`, run the way
    the train stage runs it (torchrun -> engine.worker); the log goes to work/log.txt. Past
    `timeout` seconds torchrun and its workers are killed together (return code 124)."""
    cfg = load_config(ROOT / "params/default.yaml", overrides)
    work.mkdir(parents=True, exist_ok=True)
    paths = RunPaths(project_root=ROOT, train_data=train_data, eval_data=eval_data,
                     checkpoints=work / "checkpoints", trained=work / "trained",
                     metrics_file=work / "train.json", plots_dir=work / "plots")
    job = JobSpec(config=cfg.model_dump(mode="json"), paths=paths,
                  error_dir=str(work)).write(work / "job.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "engine.worker", str(job)]
    proc = run_killable(cmd, timeout, env)
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    return proc


def run_killable(cmd: list[str], timeout: float | None = None, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """`cmd` from the project root in its own process group, killed with all its children
    past `timeout` seconds (return code 124, what it printed until then kept)."""
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=timeout)
            code = child.returncode
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            code = 124
    return subprocess.CompletedProcess(cmd, code, out, err)


def run_job(name: str, overrides: dict, tokenized: Path, out: Path) -> Path:
    work = out / name
    started = time.perf_counter()
    proc = launch(work, overrides, tokenized / "train", tokenized / "test")
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    print(f"{name}: {time.perf_counter() - started:.1f} s", flush=True)
    return work


def losses(work: Path) -> list[float]:
    with open(work / "plots/train.csv") as fh:
        return [float(r["loss"]) for r in csv.DictReader(fh)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenized", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    base = {"training.max_steps": args.steps, "logging.logging_steps": 1,
            "eval.eval_steps": args.steps // 2, "checkpoint.save_steps": args.steps // 2,
            "checkpoint.save_total_limit": 10, "logging.report_to": []}
    bf16 = {**base, "training.mixed_precision": "bf16"}
    runs = {
        "fp32": base,
        "bf16-padded": bf16,
        "bf16-packed": {**bf16, "training.packing": True},
        "bf16-padding-free": {**bf16, "training.padding_free": True},
    }
    done = {name: run_job(name, o, args.tokenized, args.out) for name, o in runs.items()}
    # resume: the fp32 run cut back to its middle checkpoint, then continued
    cut = args.out / "fp32-resumed"
    shutil.copytree(done["fp32"], cut)
    shutil.rmtree(cut / "trained")
    shutil.rmtree(cut / f"checkpoints/step-{args.steps:07d}")
    resumed = run_job("fp32-resumed", {**base, "checkpoint.resume_from_checkpoint": True},
                      args.tokenized, args.out)
    same = ((done["fp32"] / "trained/adapter_model.safetensors").read_bytes()
            == (resumed / "trained/adapter_model.safetensors").read_bytes())
    ref = losses(done["bf16-padded"])
    print(f"\ndevice: {device}, torch {torch.__version__}\n")
    print("| run | final loss | max |loss - bf16 padded| | tokens/s (run) |")
    print("|---|---|---|---|")
    for name, work in {**done, "fp32-resumed": resumed}.items():
        ls = losses(work)
        diff = max(abs(a - b) for a, b in zip(ls, ref)) if name.startswith("bf16") else None
        tps = json.loads((work / "train.json").read_text())["train_tokens_per_second"]
        shown = "-" if diff is None else f"{diff:.2e}"
        print(f"| {name} | {ls[-1]:.6f} | {shown} | {tps:,.0f} |")
    print(f"\nresumed adapter bytes equal to uninterrupted: {same}")
    json.dump({"device": device, "resume_bitwise": same,
               "final_losses": {n: losses(w)[-1] for n, w in done.items()}},
              open(args.out / "summary.json", "w"), indent=2)
    if not same:
        raise SystemExit("resume was not bitwise exact")


if __name__ == "__main__":
    main()
