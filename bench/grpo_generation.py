"""What GRPO's in-process generation costs: `LocalGenerator` (engine/rollout/local.py)
against `model.generate(do_sample=True, num_return_sequences=G)`, the same model, prompts and
sampling parameters, the same work (B prompts x G generations x T new tokens).

The prompts are the first sentences of TinyStories-like text, left-padded; the model is
stories260K as shipped (its EOS is practically never sampled, so every row runs T tokens and
both sides do the same number of forwards: the table's `tokens` column says so), or a randomly
initialised Llama of a bench/throughput.py shape. model.generate runs after torch.manual_seed(0)
and LocalGenerator with seed 0, which on the CPU draw the same tokens. A third row is
LocalGenerator without its three levers (share_prefill=False: every row prefilled, as generate
does; drop_finished=False: finished rows stay in the forwards; lean_decode=False: the model's
forward for every token), so what they bring is measured in
the same run. `--eos TOKEN` names another token as the end (stories260K emits "<0x0A>", a
newline), so rows finish at different lengths, as completions do. Each side runs once to warm
up, then `--repeats` times, the sides taking turns within each repeat; the table gives the
median seconds and generated tokens per second.

    python bench/grpo_generation.py                       # stories260K, 8 x 8 x 128, TRL defaults
    python bench/grpo_generation.py --model llama-4M --top-k 50 --top-p 0.9

Prints a markdown table and writes bench/results/grpo-generation-<model>-cpu.json (or -<device>).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from throughput import MODELS, build_model
from workdir import ROOT, machine, markdown_table

sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.rollout.generator import left_pad  # noqa: E402
from engine.rollout.local import LocalGenerator  # noqa: E402
from engine.rollout.sampling import SamplingParams  # noqa: E402

PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The dog",
           "Tom and Sue went to the park. They played", "One day, a big bird",
           "Mom said, \"Ben, it is time for bed.\"", "There was a tiny car that liked to",
           "The sun was hot and the children", "Sam had a red ball. He"]
PAD = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def in_turns(fns, device, repeats: int) -> list[tuple[float, object]]:
    """(median seconds, last output) of each function: one warm-up each, then `repeats`
    rounds in which each runs once in turn (a load that comes and goes hits every side)."""
    for fn in fns:
        fn()
    times, outs = [[] for _ in fns], [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            _sync(device)
            start = time.perf_counter()
            outs[i] = fn()
            _sync(device)
            times[i].append(time.perf_counter() - start)
    return [(statistics.median(t), out) for t, out in zip(times, outs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stories260K", choices=list(MODELS))
    parser.add_argument("--prompts", type=int, default=8, help="B, at most %d" % len(PROMPTS))
    parser.add_argument("--generations", type=int, default=8, help="G per prompt")
    parser.add_argument("--tokens", type=int, default=128, help="T new tokens")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eos", help="a token ending completions (default: the tokenizer's EOS)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.model, Path(tmp) / "model")
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS[:args.prompts]], PAD)
    ids, mask = ids.to(device), mask.to(device)
    eos = [tok.convert_tokens_to_ids(args.eos) if args.eos else tok.eos_token_id]
    params = SamplingParams(args.tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, repetition_penalty=args.repetition_penalty)
    ours = LocalGenerator(model, params, eos, PAD)
    plain = LocalGenerator(model, params, eos, PAD, share_prefill=False, drop_finished=False,
                           lean_decode=False)

    def local():
        return ours.generate(ids, mask, args.generations, seed=0)

    def local_plain():
        return plain.generate(ids, mask, args.generations, seed=0)

    def hf():
        torch.manual_seed(0)  # the draws LocalGenerator makes with seed 0: the same tokens
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True,
                num_return_sequences=args.generations, max_new_tokens=args.tokens,
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                repetition_penalty=args.repetition_penalty, pad_token_id=PAD, eos_token_id=eos)

    (local_s, local_out), (plain_s, plain_out), (hf_s, hf_out) = in_turns(
        [local, local_plain, hf], device, args.repeats)
    hf_ids = hf_out[:, ids.shape[1]:]
    is_eos = torch.isin(hf_ids, torch.tensor(eos, device=device))
    hf_lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, hf_ids.shape[1])
    hf_tokens = int(hf_lengths.sum())
    same = hf_ids.shape == local_out.ids.shape and bool((hf_ids == local_out.ids).all())
    rows = [
        {"generator": "LocalGenerator", "seconds": round(local_s, 3),
         "tokens": int(local_out.lengths.sum()),
         "tokens_per_s": round(int(local_out.lengths.sum()) / local_s)},
        {"generator": "LocalGenerator, per-row prefill, finished rows kept",
         "seconds": round(plain_s, 3), "tokens": int(plain_out.lengths.sum()),
         "tokens_per_s": round(int(plain_out.lengths.sum()) / plain_s)},
        {"generator": "model.generate", "seconds": round(hf_s, 3), "tokens": hf_tokens,
         "tokens_per_s": round(hf_tokens / hf_s)},
    ]
    print(markdown_table(rows, list(rows[0])))
    print(f"\nmodel.generate time / LocalGenerator time: {hf_s / local_s:.2f}x "
          f"({args.prompts} prompts x {args.generations} generations x {args.tokens} tokens, "
          f"{args.model}, {device}, {torch.get_num_threads()} threads); "
          f"the same tokens: {'yes' if same else 'no'}; the levers: {plain_s / local_s:.2f}x")
    info = machine()
    name = "cpu" if device.type == "cpu" else info["device"].lower().replace(" ", "-")
    out = ROOT / f"bench/results/grpo-generation-{args.model}-{name}.json"
    out.write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows,
                               "hf_over_local": hf_s / local_s, "plain_over_local": plain_s / local_s,
                               "same_tokens": same, "loadavg": list(os.getloadavg())},
                              indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
