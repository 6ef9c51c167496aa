"""Peak memory of the memory levers against their baselines, measured in the same run: the
chunked loss (training.loss_chunk_tokens) against the full logits, and the optimizer step in
backward (training.fuse_optim_with_backward) against the step after backward.

    .venv/bin/python bench/memory_levers.py [--steps 6] [--batch 8] [--seq 512]

The model is a 20M-parameter Llama body (bench/throughput.py's llama-20M shapes) with the
GPT-2 vocabulary (50,257 tokens, ../shared/models/gpt2-tokenizer), where the logits dominate;
Alpaca from ../shared by path. Each configuration trains in its own train stage (its own
processes), and the peak is that process's: resident memory on a CPU, allocated memory on a GPU.
Activation offloading is CUDA-only (on a CPU activations live in host memory already); it is
listed, not measured, on a machine without a GPU. Writes
bench/results/memory-levers-b<batch>s<seq>-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
from pathlib import Path

from throughput import COMMON, MODELS, SHARED, prepare_data
from workdir import ROOT, copy_project, machine, markdown_table, set_params, stage, train_metrics

GPT2 = SHARED / "models/gpt2-tokenizer"
#: (lever, baseline name, lever name, params of the baseline, params of the lever)
LEVERS = [
    ("chunked loss (LoRA)", "full logits", "loss_chunk_tokens 4096",
     {"peft.use_peft": True, "training.loss_chunk_tokens": None},
     {"peft.use_peft": True, "training.loss_chunk_tokens": 4096}),
    ("optimizer in backward (full fine-tuning)", "step after backward",
     "fuse_optim_with_backward",
     {"training.max_grad_norm": None, "training.fuse_optim_with_backward": False},
     {"training.max_grad_norm": None, "training.fuse_optim_with_backward": True}),
]


def build_gpt2_vocab_model(dest: Path, shape: dict | None = None,
                           max_positions: int = 1024) -> Path:
    """A Llama of `shape` (config keys over stories260K's; default llama-20M's body) with the
    GPT-2 vocabulary and tokenizer, random init (seed 0). No pad id: stories260K's (0) is a
    real token in GPT-2's vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "data/models/stories260K")
    for key, value in (MODELS["llama-20M"] if shape is None else shape).items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    config.max_position_embeddings = max_positions
    config.vocab_size, config.bos_token_id, config.eos_token_id = 50257, 50256, 50256
    config.pad_token_id = None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    for f in GPT2.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    return dest


def peak_mb(project: Path) -> tuple[float, str]:
    m = train_metrics(project)
    if "cuda_max_memory_allocated_mb" in m:
        return m["cuda_max_memory_allocated_mb"], "cuda allocated"
    return m["memory_rss_mb"], "rss"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--workdir", help="keep the projects here (default: a temporary folder)")
    args = ap.parse_args()
    rows = []
    with (contextlib.nullcontext(args.workdir) if args.workdir
          else tempfile.TemporaryDirectory(prefix="bench-mem-")) as tmp:
        project = copy_project(Path(tmp) / "p")
        model_dir = build_gpt2_vocab_model(Path(tmp) / "model")
        set_params(project, {"model.name_or_path": str(model_dir)})
        prepare_data(project, "alpaca", args.seq)
        common = {**COMMON, "model.name_or_path": str(model_dir),
                  "training.max_steps": args.steps,
                  "training.per_device_train_batch_size": args.batch}
        for lever, base_name, lever_name, base, changed in LEVERS:
            peaks = {}
            for name, params in ((base_name, base), (lever_name, changed)):
                set_params(project, {**common, **params})
                stage(project, "train")
                peaks[name], kind = peak_mb(project)
            rows.append({"lever": lever, "baseline": base_name,
                         "baseline_peak_mb": round(peaks[base_name], 1), "with_lever": lever_name,
                         "lever_peak_mb": round(peaks[lever_name], 1),
                         "ratio": round(peaks[lever_name] / peaks[base_name], 3),
                         "measure": kind})
    import torch

    if not torch.cuda.is_available():
        rows.append({"lever": "activation offloading", "baseline": "-", "baseline_peak_mb": "-",
                     "with_lever": "enable_activation_offloading", "lever_peak_mb": "-",
                     "ratio": "-", "measure": "CUDA only: not measured on this machine"})
    where = machine()
    print(f"llama-20M body + GPT-2 vocabulary, Alpaca, batch {args.batch} x {args.seq} tokens, "
          f"{args.steps} steps, fp32; {where}\n")
    print(markdown_table(rows, list(rows[0])))
    device = "gpu" if torch.cuda.is_available() else "cpu"
    out = ROOT / "bench/results" / f"memory-levers-b{args.batch}s{args.seq}-{device}.json"
    out.write_text(json.dumps({"machine": where, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
