"""GGUF export time and file size per type, for the default model (stories260K) and a 0.4B Llama,
against the safetensors save of the same model (the baseline, measured in the same run).

    .venv/bin/python bench/gguf_export.py [--quick] [--types f16,q8_0,...]

Each row is one `write_model` call (tasks/exporters/gguf/model_file.py: the call the export
stage makes per listed type), timed end to end: plan and block checks, q/k permutation, encoding,
writing the file. `vs_safetensors` is its time over `save_pretrained`'s for the same weights
(float32, one shard); `size_vs_f32` its size over the f32 GGUF's. stories260K's 172-wide FFN fits
no quantized block, so it has the float types only. The 0.4B model is a seeded random Llama
(hidden 1024, FFN 4096, 24 layers, 16 heads / 8 KV heads, 32000-token vocabulary, untied head:
436M parameters in 2-D tensors) with the stories260K tokenizer, its vocabulary padded to
32000 as the writer pads any tokenizer smaller than the embedding. --quick: the 0.4B model with
4 layers (a 0.1B model), f16 and q4_k_m only. Writes bench/results/gguf-export[-quick]-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from workdir import ROOT, machine, markdown_table

from tasks.exporters.gguf.model_file import write_model
from tasks.exporters.gguf.quants import FILE_TYPES

STORIES = ROOT / "data/models/stories260K"
FLOAT_TYPES = ("f32", "f16", "bf16")


def llama_04b(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def measure(label: str, model, tokenizer, types: list[str], folder: Path) -> list[dict]:
    started = time.perf_counter()
    model.save_pretrained(folder / "hf", max_shard_size="100GB")
    baseline = time.perf_counter() - started
    rows, f32_size = [], None
    n_params = sum(p.numel() for p in model.parameters())
    for file_type in types:
        path = folder / f"{file_type}.gguf"
        started = time.perf_counter()
        write_model(model, tokenizer, path, file_type)
        seconds = time.perf_counter() - started
        size = path.stat().st_size
        f32_size = f32_size or (size if file_type == "f32" else None)
        rows.append({"model": label, "params_M": round(n_params / 1e6, 1), "type": file_type,
                     "seconds": round(seconds, 4), "MB": round(size / 1e6, 2),
                     "vs_safetensors": round(seconds / baseline, 2),
                     "size_vs_f32": round(size / f32_size, 3) if f32_size else None,
                     "safetensors_seconds": round(baseline, 4)})
        print(f"{label} {file_type}: {seconds:.2f} s, {size / 1e6:.2f} MB", flush=True)
        path.unlink()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 4-layer 0.4B-shaped model, 2 types")
    ap.add_argument("--types", default=",".join(FILE_TYPES),
                    help="comma-separated export.gguf types for the 0.4B model")
    args = ap.parse_args()
    types = ["f16", "q4_k_m"] if args.quick else args.types.split(",")
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    stories = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += measure("stories260K", stories, tokenizer,
                        ["f16"] if args.quick else list(FLOAT_TYPES), Path(tmp) / "stories")
    layers = 4 if args.quick else 24
    with tempfile.TemporaryDirectory() as tmp:
        rows += measure(f"llama-{layers}L-1024", llama_04b(layers), tokenizer,
                        (["f32"] if "f32" not in types else []) + types, Path(tmp) / "big")
    where = {**machine(), "load_average": os.getloadavg()}
    print(f"\n{where}\n")
    print(markdown_table(rows, list(rows[0])))
    out = ROOT / "bench/results" / f"gguf-export{'-quick' if args.quick else ''}-cpu.json"
    out.write_text(json.dumps({"machine": where, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
