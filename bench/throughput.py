"""Training throughput: our train stage vs `transformers.Trainer`, same model, data, precision,
batch, steps and example order (see bench/hf_trainer.py), plus the matmul ceiling for MFU.

Our stage runs three times: padded (the same work HF does, which checks the loops are equally
fast), packed rows (`training.packing`) and padding-free (`training.padding_free`, the lever: no
padding compute at all, attention per example). Useful tokens are the non-pad
tokens; MFU = 6 x params x useful tokens/s / the matmul GFLOP/s measured at the model's shapes
in this same run (attention FLOPs ignored, embeddings counted: roughly cancelling).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from same_batches import our_order
from workdir import ROOT, SHARED, set_params, stage, train_metrics

ALPACA = {
    "data.data_files": {"train": str(SHARED / "data/alpaca_2k.json")},
    "data.prompt_template": "Below is an instruction that describes a task. Write a response "
                            "that appropriately completes the request.\n\n### Instruction:\n"
                            "{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
    "data.completion_template": "{output}",
}
DATASETS = {"alpaca": ALPACA, "gsm8k": {}}
#: Llama shapes; vocabulary and tokenizer are stories260K's (512 tokens), so every model reads
#: the same tokenized data
MODELS = {
    "stories260K": None,
    "llama-4M": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
                 "num_attention_heads": 8, "num_key_value_heads": 8},
    "llama-20M": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
                  "num_attention_heads": 8, "num_key_value_heads": 8},
}
COMMON = {"peft.use_peft": False, "checkpoint.save_strategy": "no", "eval.eval_strategy": "no",
          "logging.logging_steps": 1, "optimizer.learning_rate": 1e-3,
          "optimizer.weight_decay": 0.0, "scheduler.name": "cosine",
          # fused AdamW, as HF's optim="adamw_torch_fused" in bench/hf_trainer.py
          "optimizer.kwargs": {"fused": True},
          "scheduler.warmup_steps": 2, "training.per_device_train_batch_size": 8,
          "training.gradient_accumulation_steps": 1, "training.seed": 42,
          "registry.register_model": False,
          # ATen's kernels for this CPU, as HF runs (params/default.yaml pins portable ones)
          "training.cpu_numerics": "native"}


def build_model(name: str, dest: Path) -> Path:
    """stories260K as shipped, or a randomly initialised Llama of the given shape."""
    source = ROOT / "data/models/stories260K"
    if MODELS[name] is None:
        return source
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    for key, value in MODELS[name].items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(dest)
    for f in source.iterdir():
        if "token" in f.name:
            shutil.copy2(f, dest / f.name)
    return dest


def n_params(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def matmul_ceiling(hidden: int, inter: int, dtype: str, tokens: int = 2048) -> float:
    """Best GFLOP/s torch reaches on this machine for the GEMMs a training step of this model
    runs: the MLP projection's forward (T x h @ h x i), input gradient (T x i @ i x h) and
    weight gradient (h x T @ T x i), each with both operands contiguous (NN) and with one
    transposed (NT, TN). One forward shape alone under-reads the ceiling at small hidden sizes,
    and on CPUs without bf16 matmul units bf16 NN runs 10-20x slower than NT/TN (see
    engine/modeling/cpu_linear.py): the best of all of them is what the hardware can do."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    shapes = [(tokens, hidden, inter), (tokens, inter, hidden), (hidden, tokens, inter)]
    best = 0.0
    for m, k, n in shapes:
        flops = 2 * m * k * n
        for a, b in ((torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)),  # NN
                     (torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt).t()),  # NT
                     (torch.randn(k, m, dtype=dt).t(), torch.randn(k, n, dtype=dt))):  # TN
            t = time.perf_counter()
            a @ b  # warm-up, and the measurement of a slow layout (no point repeating it)
            best = max(best, flops / (time.perf_counter() - t) / 1e9)
            if time.perf_counter() - t > 0.2:
                continue
            reps = max(3, int(5e8 / flops))
            for _ in range(4):
                t = time.perf_counter()
                for _ in range(reps):
                    a @ b
                best = max(best, flops * reps / (time.perf_counter() - t) / 1e9)
    return best


def prepare_data(project: Path, dataset: str, max_len: int) -> Path:
    set_params(project, {**DATASETS[dataset], "data.max_seq_length": max_len,
                         "data.max_dropped_fraction": 0.5})
    for name in ("download", "format", "tokenize"):
        stage(project, name)
    return project / "data/tokenized/train"


#: our train stage's batch layouts: the same padding HF does, packed rows, one padding-free row
LAYOUTS = {"padded": {}, "packed": {"training.packing": True},
           "padfree": {"training.padding_free": True}}


def run_ours(project: Path, model_dir: Path, precision: str, steps: int, layout: str,
             extra: dict | None = None) -> dict:
    """Our train stage with COMMON, the layout's params and then `extra` (other benchmarks'
    settings)."""
    set_params(project, {**COMMON, "model.name_or_path": str(model_dir),
                         "training.mixed_precision": precision, "training.max_steps": steps,
                         "training.packing": False, "training.padding_free": False,
                         **LAYOUTS[layout], **(extra or {})})
    launched = time.time()
    wall = stage(project, "train")
    m = train_metrics(project)
    import csv

    with open(project / "data/plots/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    return {"tokens_per_s": m["num_input_tokens_seen"] / m["train_runtime"],
            # after training.speed_metrics_start_step (0: the whole run)
            "window_tokens_per_s": m["train_tokens_per_second"],
            "padding_fraction": m["padding_fraction"], "final_loss": float(rows[-1]["loss"]),
            "peak_rss_mb": m["memory_rss_mb"], "stage_wall_s": wall,
            "train_runtime_s": m["train_runtime"],
            "startup_s": m["first_step_unix"] - launched}  # launch to first optimizer step


def run_hf(project: Path, model_dir: Path, precision: str, steps: int, order: list[int],
           options: dict | None = None, env: dict | None = None) -> dict:
    """bench/hf_trainer.py in its own process; `options` adds to its spec (peer settings),
    `env` to its environment."""
    spec = {**(options or {}), "train": str(project / "data/tokenized/train"),
            "model": str(model_dir),
            "precision": precision, "batch": COMMON["training.per_device_train_batch_size"],
            "steps": steps, "learning_rate": COMMON["optimizer.learning_rate"],
            "weight_decay": 0.0, "warmup_steps": COMMON["scheduler.warmup_steps"],
            "seed": 42, "order": order, "threads": os.cpu_count() or 1,
            "output_dir": str(project / "hf-out")}
    spec_file, out_file = project / "hf-spec.json", project / "hf-result.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(ROOT / "bench/hf_trainer.py"), str(spec_file),
                           str(out_file)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"HF Trainer failed:\n{proc.stderr[-3000:]}")
    r = json.loads(out_file.read_text())
    return {"tokens_per_s": r["useful_tokens"] / r["train_runtime"],
            # after spec["warmup_window"] steps (the whole run without one)
            "window_tokens_per_s": r["window_tokens"] / r["window_seconds"],
            "padding_fraction": r["padding_fraction"], "final_loss": r["losses"][-1],
            "peak_rss_mb": r["peak_rss_mb"], "train_runtime_s": r["train_runtime"]}


def compare(project: Path, dataset: str, model: str, model_dir: Path, precision: str,
            steps: int, ceiling: float, params: int, layouts=tuple(LAYOUTS)) -> dict:
    import datasets

    n_rows = len(datasets.load_from_disk(str(project / "data/tokenized/train")))
    order = our_order(n_rows, COMMON["training.per_device_train_batch_size"], steps, 42)
    hf = run_hf(project, model_dir, precision, steps, order)
    ours = {name: run_ours(project, model_dir, precision, steps, name) for name in layouts}
    best = ours[next(n for n in reversed(LAYOUTS) if n in ours)]  # padfree when it ran

    def mfu(tps):
        return 6 * params * tps / (ceiling * 1e9)

    row = {"dataset": dataset, "model": model, "params_M": params / 1e6, "precision": precision,
           "hf_tok_s": hf["tokens_per_s"], "hf_padding": hf["padding_fraction"],
           "hf_loss": hf["final_loss"], "hf_rss_mb": hf["peak_rss_mb"],
           "mfu_hf": mfu(hf["tokens_per_s"]), "ceiling_gflops": ceiling}
    for name, r in ours.items():
        row.update({f"ours_{name}_tok_s": r["tokens_per_s"],
                    f"ratio_{name}_vs_hf": r["tokens_per_s"] / hf["tokens_per_s"],
                    f"ours_{name}_padding": r["padding_fraction"],
                    f"ours_{name}_loss": r["final_loss"],
                    f"ours_{name}_rss_mb": r["peak_rss_mb"]})
    row.update({"mfu_ours_best": mfu(best["tokens_per_s"]),
                "train_startup_s": best["startup_s"]})
    return row
