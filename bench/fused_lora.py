"""training.fused_lora against peft's own LoRA forward: one decoder block's seven adapted
projections, forward and backward, in one process, on any device.

    python bench/fused_lora.py [--shape smollm2-135M|llama-8B] [--tokens 2048] [--rank 16]
                               [--dtype fp32|bf16] [--device cpu|cuda] [--repeats 20]

Needs torch and peft only (no orchestration stack), so it runs on a lent GPU machine as is.
The block is peft's LoRA on q/k/v/o/gate/up/down of the named shape's projections, fed
`tokens` rows (a padding-free micro-batch): each timed round runs all seven layers' forward
and backward with random upstream gradients, base weights frozen, as a LoRA step does. Both
variants run alternately in the same process (`--repeats` rounds each, after 3 warm-up
rounds); the median round time of each and their ratio are printed and written to
bench/results/fused-lora-<shape>-<dtype>-<device>.json. `--dtype bf16` is autocast, as
training.mixed_precision bf16 runs. A machine's own numbers only: the ratio is measured
against peft in the same run, on the hardware the record names.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: shape -> (hidden, kv projection width, FFN width)
SHAPES = {"smollm2-135M": (576, 192, 1536), "llama-8B": (4096, 1024, 14336)}


def build(shape: str, rank: int, device):
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    hidden, kv, ffn = SHAPES[shape]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                    "o_proj": (hidden, hidden), "gate_proj": (hidden, ffn),
                    "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
            for name, (i, o) in dims.items():
                setattr(self, name, nn.Linear(i, o, bias=False))

    torch.manual_seed(0)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"])
    return get_peft_model(Block(), config).to(device)


def one_round(block, inputs: dict, upstream: dict, dtype) -> None:
    import torch

    with torch.autocast(inputs["q_proj"].device.type, dtype=dtype, enabled=dtype is not None):
        outs = {name: getattr(block.base_model.model, name)(x) for name, x in inputs.items()}
    torch.autograd.backward([outs[n] for n in outs], [upstream[n].to(outs[n].dtype)
                                                    for n in outs])


def measure(args) -> dict:
    import torch

    from engine.modeling.fused_lora import restore_lora_forward, use_fused_lora

    device = torch.device(args.device)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.dtype]
    block = build(args.shape, args.rank, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    inputs, upstream = {}, {}
    for name, layer in block.base_model.model.named_children():
        base = layer.base_layer
        inputs[name] = torch.randn(args.tokens, base.in_features, generator=g).to(device)
        inputs[name].requires_grad_()
        upstream[name] = torch.randn(args.tokens, base.out_features, generator=g).to(device)

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        one_round(block, inputs, upstream, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        for p in [*block.parameters(), *inputs.values()]:
            p.grad = None
        return time.perf_counter() - start

    times = {"peft": [], "fused": []}
    for i in range(3 + args.repeats):
        for variant in times:
            (use_fused_lora if variant == "fused" else restore_lora_forward)(block)
            took = timed()
            if i >= 3:
                times[variant].append(took)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": args.shape, "tokens": args.tokens, "rank": args.rank, "dtype": args.dtype,
            "device": args.device, "repeats": args.repeats,
            "peft_ms": median["peft"] * 1e3, "fused_ms": median["fused"] * 1e3,
            "speedup": median["peft"] / median["fused"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135M")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda: no CUDA GPU is visible here", file=sys.stderr)
            raise SystemExit(2)
    from workdir import machine

    record = {"machine": machine(), **measure(args)}
    print(f"{args.shape} x{args.tokens} tokens r{args.rank} {args.dtype} on "
          f"{record['machine']['device']}: peft {record['peft_ms']:.2f} ms, fused "
          f"{record['fused_ms']:.2f} ms per block step: {record['speedup']:.3f}x")
    device = record["machine"]["device"].lower().replace(" ", "-")
    out = ROOT / "bench/results" / f"fused-lora-{args.shape}-{args.dtype}-{device}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
