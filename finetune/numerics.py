"""CPU numerics: the same bytes from the same inputs on any x86-64 machine (portable mode).

Why this exists: torch's CPU kernels choose their instructions when they first run, by what
the CPU offers. ATen's vectorised kernels (softmax, norms, reductions, the optimizer's foreach
ops) take AVX-512 where the CPU has it and AVX2 elsewhere; MKL's GEMM picks a code path and a
blocking per CPU; oneDNN likewise; and a parallel reduction splits its work by the thread
count. Each choice changes the order of floating-point sums, so the default run trained
different adapter bytes on two machines of the kind this project runs on, while reruns on one
machine were bitwise equal.

`training.cpu_numerics: portable` pins each choice to one every x86-64 CPU with AVX2 can make:
ATen's AVX2 kernels, MKL's COMPATIBLE reproducibility branch (the only one MKL honours on both
Intel and AMD CPUs), oneDNN's AVX2 ceiling, and a fixed number of threads per process. The
libraries read these from the environment when they first run, so they are set before torch
does any work: by `finetune stage` before it imports a stage (flows/cli.py), and by the train
stage for its torchrun workers (tasks/launch.py). `native` leaves every choice to the machine
(fastest; bitwise equal on the same machine only). On a CUDA device the GPU's kernels decide,
and on a CPU without x86-64 AVX2 portable mode cannot hold: both run native, and say so.

Nothing here imports torch: it must run before torch is loaded.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PORTABLE, NATIVE = "portable", "native"
#: what portable mode pins, as the libraries' own environment variables
PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's dispatch: its AVX2 kernels, never AVX-512
    "MKL_CBWR": "COMPATIBLE",  # MKL conditional numerical reproducibility, vendor-neutral
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's instruction ceiling
}
#: torch threads per process in portable mode when distributed.threads_per_process is unset:
#: a parallel reduction's result depends on how many threads split it, so the count cannot
#: follow the machine's cores
PORTABLE_THREADS = 2
#: the CPU flags the lineage records (what decides which kernels a native run takes)
RECORDED_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                  "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                  "amx_bf16", "amx_int8", "asimd", "sve")
#: where a mode's settings live in the lineage (tasks/tracking.py)
LINEAGE_PREFIX = "numerics."


@lru_cache(maxsize=1)
def cpu() -> dict[str, str]:
    """This machine's CPU as the lineage records it: architecture, model name, vendor, and
    which of RECORDED_FLAGS it has (Linux's /proc/cpuinfo; elsewhere the architecture only)."""
    info = {"arch": platform.machine() or "unknown", "model": platform.processor() or "unknown",
            "vendor": "unknown", "flags": ""}
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return info
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block describes them all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    info["model"] = fields.get("model name", info["model"])
    info["vendor"] = fields.get("vendor_id", info["vendor"])
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    info["flags"] = ",".join(f for f in RECORDED_FLAGS if f in flags)
    return info


def gpu_visible() -> bool:
    """Whether torch would see a GPU here, without importing torch (it must not load before
    the pins are set): an NVIDIA or AMD driver's device, unless CUDA_VISIBLE_DEVICES hides it."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (nvidia.is_dir() and any(nvidia.iterdir())) or Path("/dev/kfd").exists()


def portable_blocker(device: str) -> str | None:
    """Why portable mode cannot hold for a run on `device` (None: it can)."""
    if device == "cuda":
        return "the run uses a CUDA GPU, whose kernels decide its numerics"
    machine = cpu()
    if machine["arch"] not in ("x86_64", "AMD64"):
        return f"this CPU is {machine['arch']}, and portable numerics are x86-64's (AVX2)"
    have = set(machine["flags"].split(","))
    missing = [f for f in ("avx2", "fma") if f not in have]
    if missing:
        return f"this x86-64 CPU lacks {' and '.join(missing)}, which portable numerics need"
    return None


@dataclass(frozen=True)
class Plan:
    """The numerics a stage process and its workers run with."""

    asked: str  # training.cpu_numerics
    mode: str  # what runs: portable, or native (asked, or portable cannot hold: `why`)
    why: str | None
    threads: int  # torch threads per process
    env: dict[str, str]  # the variables set before torch loads (portable's pins)


def plan(cfg) -> Plan:
    """The plan for a validated config: training.cpu_numerics on the resolved device, with
    distributed.threads_per_process (portable: that, or PORTABLE_THREADS; native: that, or
    the cores shared among the node's processes)."""
    asked = cfg.training.cpu_numerics
    device = cfg.training.resolved_device
    if device == "auto":
        device = "cuda" if gpu_visible() else "cpu"
    why = portable_blocker(device) if asked == PORTABLE else None
    mode = PORTABLE if asked == PORTABLE and why is None else NATIVE
    configured = cfg.distributed.threads_per_process
    if configured:
        n = configured
    elif mode == PORTABLE:
        n = PORTABLE_THREADS
    else:
        n = max(1, (os.cpu_count() or 1) // max(cfg.distributed.nproc_per_node, 1))
    env = ({**PORTABLE_ENV, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}
           if mode == PORTABLE else {})
    return Plan(asked, mode, why, n, env)


def enter(p: Plan, argv: list[str] | None = None) -> None:
    """Make this command's process run with the plan's pins before torch does any work.
    `argv`: how the process was started, after the interpreter (['-m', 'flows.cli', ...]),
    needed only when torch is already loaded (a params-named module imported it): the
    process then starts itself again with the variables set, since the pins are read when
    the kernels first run.
    Only a command's own process calls this (flows/cli.py): a caller running a stage inside
    its own process (a test, a notebook) keeps its kernels and environment, and the train
    stage still hands the pins to its torchrun workers (tasks/launch.py)."""
    differs = {k: v for k, v in p.env.items() if os.environ.get(k) != v}
    if not differs:
        return
    if "torch" in sys.modules and argv is None:
        raise RuntimeError("numerics.enter: torch is already loaded and there is no command "
                           "line to start again with the pins set")
    os.environ.update(differs)
    if "torch" in sys.modules:
        os.execv(sys.executable, [sys.executable, *argv])


def settings(p: Plan) -> dict[str, str]:
    """The numerics a run used and the CPU it ran on, for the lineage (`numerics.*`): the
    pins as this process's environment has them (portable's own, or what a native run was
    started with)."""
    machine = cpu()
    out = {"mode": p.mode, "threads": str(p.threads),
           **{k: p.env.get(k, os.environ.get(k, "")) for k in PORTABLE_ENV},
           "cpu_arch": machine["arch"], "cpu_model": machine["model"],
           "cpu_vendor": machine["vendor"], "cpu_flags": machine["flags"]}
    if p.why:
        out["not_portable_because"] = p.why
    return {LINEAGE_PREFIX + k: v for k, v in out.items()}


def comparable(recorded: dict[str, str], here: dict[str, str]) -> str | None:
    """Why bytes made with `recorded` settings need not equal bytes made `here` (None: they
    must be equal). Portable runs on both sides compare equal on any CPU; otherwise the mode,
    the pins, the thread count and the CPU's flags must all match."""
    keys = ("mode", "threads", *PORTABLE_ENV)
    first = next((k for k in keys if recorded.get(LINEAGE_PREFIX + k)
                  != here.get(LINEAGE_PREFIX + k)), None)
    if first is not None:
        key = LINEAGE_PREFIX + first
        return (f"{key} was {recorded.get(key) or 'unset'!s}, here it is "
                f"{here.get(key) or 'unset'}")
    if here.get(LINEAGE_PREFIX + "mode") == PORTABLE:
        return None
    for key in ("cpu_arch", "cpu_flags", "cpu_model"):
        full = LINEAGE_PREFIX + key
        if recorded.get(full) != here.get(full):
            return (f"native numerics on another CPU ({full}: recorded "
                    f"{recorded.get(full) or 'unknown'}, here {here.get(full) or 'unknown'})")
    return None
