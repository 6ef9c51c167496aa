"""The cost of portable CPU numerics (training.cpu_numerics: portable, finetune/numerics.py):
training steps per second with the pins against native numerics, same model, batch and thread
count, measured in the same run.

    python bench/cpu_numerics.py [--steps 30] [--rounds 3] [--threads 1] [--model DIR]

Each measurement is a fresh process (the pins are read when torch's kernels first run): a
LoRA model (r 16, all linear layers, as the default run) trained `steps` AdamW steps on
random tokens (batch 8 x 512, the default run's shape), timed after two warm-up steps. Native
and portable alternate `rounds` times, so a busy machine slows both alike; the ratio is of
the medians. Results go to bench/results/cpu-numerics-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workdir import ROOT, machine  # noqa: E402

RESULTS = ROOT / "bench/results/cpu-numerics-cpu.json"
PINS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS",
        "MKL_NUM_THREADS")

STEPS = r"""
import json, sys, time
from types import SimpleNamespace
mode, model_dir, steps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from finetune import numerics
cfg = SimpleNamespace(training=SimpleNamespace(cpu_numerics=mode, resolved_device="cpu"),
                      distributed=SimpleNamespace(threads_per_process=threads, nproc_per_node=1))
numerics.enter(numerics.plan(cfg))
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.set_num_threads(threads)
torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                       LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (8, 512))
def step():
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
for _ in range(2):
    step()
start = time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"steps_per_s": steps / (time.perf_counter() - start),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def measure(mode: str, model: Path, steps: int, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PINS}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", STEPS, mode, str(model), str(steps),
                          str(threads)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=ROOT / "data/models/stories260K")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"native": [], "portable": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(measure(mode, args.model, args.steps, args.threads))
    speed = {mode: statistics.median(r["steps_per_s"] for r in rows)
             for mode, rows in runs.items()}
    result = {"machine": machine(), "model": args.model.name, "steps": args.steps,
              "rounds": args.rounds, "threads": args.threads, "batch": [8, 512],
              **{f"{mode}_steps_per_s": round(v, 3) for mode, v in speed.items()},
              **{f"{mode}_capability": rows[0]["capability"] for mode, rows in runs.items()},
              "portable_vs_native": round(speed["portable"] / speed["native"], 3)}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
