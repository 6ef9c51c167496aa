"""Where a traced step's time goes, from the Chrome traces `logging.profiler` writes (ours, and
HF's or TRL's through bench/hf_trainer.py's profile option), side by side: per step the host's
wall time, the GPU's busy time (the union of kernel intervals), kernel launches, host syncs
(device-to-host copies and the synchronize calls the host waited in), the gaps in which the GPU
had nothing to run, and kernel time split into GEMMs, attention, optimizer, loss, compiled
(Triton) fusions, normalisation and other elementwise work.

    python bench/trace_summary.py "ours=TRACE.json" "HF compile=TRACE.json" [--out FILE.md]

Reads only the trace (no torch): it runs on the GPU machine after bench/gpu.py --profile, or
here on traces brought back. Why: the ops table sorts ops by self time but cannot say whether a
step is bound by the GPU's arithmetic or by the host feeding it, which is what decides the next
change (fewer kernels, fewer syncs, or faster kernels).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

#: kernel families, first match wins (attention before GEMM: memory-efficient attention's
#: kernels are CUTLASS kernels too)
FAMILIES = [
    ("attention", r"flash|fmha|attn|attention|sdpa|varlen|mem_eff|cudnn"),
    ("optimizer", r"multi_tensor|adam|foreach|fused_sgd"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|logsumexp"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|splitk|matmul|sm90_"),
    ("compiled (Triton)", r"^triton_|triton"),
    ("norm", r"rms_?norm|layer_?norm|norm_"),
    ("NCCL", r"nccl"),
    ("elementwise/reduce", r"elementwise|vectorized|reduce|unrolled|index|copy|fill|cat|"
                           r"scatter|gather|where|softmax|silu|mul|add"),
]
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize"}
LAUNCH_CALLS = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|"
                          r"cuLaunchKernelEx|cudaLaunchCooperativeKernel|cudaGraphLaunch)")
#: a gap between kernels longer than this is counted as the GPU waiting on the host
GAP_US = 5.0


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(events: list[dict]) -> dict:
    """The per-step numbers of one trace (times in milliseconds per step)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # the host's step marks (the profiler repeats each on the GPU's timeline as a
    # gpu_user_annotation, which would count every step twice)
    steps = [e for e in complete if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") == "user_annotation"]
    n = max(len(steps), 1)
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    runtime = [e for e in complete if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    copies = [e for e in complete if e.get("cat") == "gpu_memcpy"]
    host_wall = (max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)
                 if steps else 0.0)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    busy = union(spans)
    gpu_span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    gaps, end = [], None
    for s, e in sorted(spans):
        if end is not None and s - end > GAP_US:
            gaps.append(s - end)
        end = e if end is None else max(end, e)
    # optimizer kernels by the host annotation they were launched under (torch's
    # Optimizer.step record_function), matched through the runtime call's correlation id
    opt_windows = [(e["ts"], e["ts"] + e["dur"]) for e in complete
                   if str(e.get("name", "")).startswith("Optimizer.step")]
    launch_ts = {e.get("args", {}).get("correlation"): e["ts"] for e in runtime}
    by_family: dict[str, float] = defaultdict(float)
    by_name: Counter = Counter()
    count_by_name: Counter = Counter()
    for k in kernels:
        fam = family(k["name"])
        t = launch_ts.get(k.get("args", {}).get("correlation"))
        if t is not None and any(a <= t <= b for a, b in opt_windows):
            fam = "optimizer"
        by_family[fam] += k["dur"]
        by_name[k["name"]] += k["dur"]
        count_by_name[k["name"]] += 1
    syncs = [e for e in runtime if e["name"] in SYNC_CALLS]
    dtoh = [e for e in copies if "DtoH" in e["name"] or "Device -> Pageable" in e["name"]
            or "Device -> Pinned" in e["name"]]
    ms = 1e-3 / n
    return {
        "steps": len(steps),
        "host_wall_ms": host_wall * ms,
        "gpu_span_ms": gpu_span * ms,
        "gpu_busy_ms": busy * ms,
        "gpu_busy_fraction": busy / host_wall if host_wall else None,
        "kernels": len(kernels) / n,
        "launch_calls": sum(1 for e in runtime if LAUNCH_CALLS.match(e["name"])) / n,
        "graph_launches": sum(1 for e in runtime if e["name"].startswith("cudaGraphLaunch")) / n,
        "host_syncs": len(syncs) / n,
        "host_sync_wait_ms": sum(e["dur"] for e in syncs) * ms,
        "dtoh_copies": len(dtoh) / n,
        "gaps_over_5us": len(gaps) / n,
        "gap_ms": sum(gaps) * ms,
        "family_ms": {f: v * ms for f, v in sorted(by_family.items(), key=lambda x: -x[1])},
        "top_kernels": [(name, t * ms, count_by_name[name] / n)
                        for name, t in by_name.most_common(15)],
    }


def table(summaries: dict[str, dict]) -> str:
    """Markdown: one column per trace."""
    names = list(summaries)
    head = "| per step | " + " | ".join(names) + " |\n|---|" + "---|" * len(names)
    rows = [("host wall (ms)", "host_wall_ms", "{:.1f}"),
            ("GPU busy (ms, union of kernels)", "gpu_busy_ms", "{:.1f}"),
            ("GPU busy / host wall", "gpu_busy_fraction", "{:.0%}"),
            ("kernels", "kernels", "{:,.0f}"), ("launch calls", "launch_calls", "{:,.0f}"),
            ("CUDA graph launches", "graph_launches", "{:,.0f}"),
            ("host syncs (synchronize calls)", "host_syncs", "{:.1f}"),
            ("host time waiting in syncs (ms)", "host_sync_wait_ms", "{:.1f}"),
            ("device-to-host copies", "dtoh_copies", "{:.1f}"),
            ("idle gaps > 5 us", "gaps_over_5us", "{:,.0f}"),
            ("idle time in those gaps (ms)", "gap_ms", "{:.1f}")]
    lines = [head]
    for label, key, fmt in rows:
        cells = [fmt.format(s[key]) if s.get(key) is not None else "-"
                 for s in summaries.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    fams = sorted({f for s in summaries.values() for f in s["family_ms"]},
                  key=lambda f: -max(s["family_ms"].get(f, 0) for s in summaries.values()))
    for fam in fams:
        lines.append(f"| kernel time: {fam} (ms) | " + " | ".join(
            f"{s['family_ms'].get(fam, 0.0):.2f}" for s in summaries.values()) + " |")
    for name, s in summaries.items():
        lines += ["", f"Top kernels, {name} (ms per step, launches per step):", "",
                  "| kernel | ms | count |", "|---|---|---|"]
        lines += [f"| `{k[:90]}` | {t:.2f} | {c:.0f} |" for k, t, c in s["top_kernels"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", help="NAME=PATH (a Chrome trace, .json or .json.gz)")
    ap.add_argument("--out", type=Path, help="also write the table (and a .json beside it)")
    args = ap.parse_args()
    summaries = {}
    for item in args.traces:
        name, _, path = item.rpartition("=")
        summaries[name or path] = summarise(load(Path(path)))
    text = table(summaries)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".summary.json").write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
