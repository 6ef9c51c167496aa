"""glibc malloc settings for the training processes: keep freed memory for reuse.

A CPU training step frees and allocates the same large tensors every step (logits, their
log-softmax and its gradient, the MLP activations). glibc serves an allocation above its
mmap threshold (at most 32 MB) with a fresh mmap and returns it to the kernel on free, so
every step page-faults those megabytes in again and the kernel zeroes them: on the 2-core dev
CPU a 432 x 50,257 fp32 log-softmax took 26 ms with a fresh output and 11 ms with reused
memory, and the train stage ran 1.22x the tokens/s on bench/peers_cpu.py's 29M model (1,580
against 1,300; nothing measurable on its 135M LoRA row, whose largest tensors are smaller). With
mmap off and no trimming, freed blocks stay in the heap and the next step reuses them once the
heap has settled (a few steps), at the price of a higher resident peak (the heap does not
shrink; 2,555 against 2,141 MB on the 29M row).

`training.cpu_malloc_reuse` (default true) sets these for the torchrun workers (local and
SLURM); glibc reads them at process start, and results do not depend on them. A process on
another libc ignores them.
"""

from __future__ import annotations

#: no mmap for large blocks (they come from the heap) and never trim the heap's top
MALLOC_REUSE_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}


def worker_env(cfg) -> dict[str, str]:
    """The variables the train stage's workers get for a validated config."""
    return dict(MALLOC_REUSE_ENV) if cfg.training.cpu_malloc_reuse else {}
