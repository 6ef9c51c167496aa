"""Why a torchrun job failed, in one line: the workers' reports plus torchrun's own summary.

Each failing rank writes a report (engine.process.failures); a rank that died without one (SIGKILL
from the kernel's out-of-memory killer, a segfault) only shows in torchrun's failure summary, and a
rendezvous that never completed only in torchrun's log. The order of preference: bad input;
the first failure torchrun observed, when it was a death by signal; the reports by kind (disk,
memory, crash before a rank's share of a failed checkpoint save and lost contact, which are
usually a consequence of another rank's failure);
a failed rendezvous. None of these: None, and the caller shows torchrun's log.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from engine.process.failures import INTACT, KINDS, Report
from finetune.config.distributed import DistributedConfig
from finetune.errors import PipelineError, TransientError


class RunFailure(PipelineError):
    """The run failed for a reason outside the params (a resource, a process, the network)."""

    exit_code = 1


_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
_RDZV = ("RendezvousTimeoutError", "RendezvousConnectionError", "RendezvousClosedError",
         "RendezvousError", "DistStoreError", "The server socket has failed to listen")
RESUME = "rerun with checkpoint.resume_from_checkpoint: true"


def explain(reports: list[Report], torchrun_log: str, dist: DistributedConfig,
            log_file: Path) -> PipelineError | None:
    """The one error that explains a failed job; `log_file` holds the workers' full stderr."""
    for report in reports:
        if report.kind == "input":
            return PipelineError(report.message)
    # torchrun's summary: the root cause (first observed failure) first, then the others
    cut = torchrun_log.rfind("Root Cause")
    summary = (torchrun_log[cut:] if cut >= 0 else "") + torchrun_log
    failures = [(int(r), int(c)) for r, c in _FAILURE.findall(summary)]
    by_rank = {r.rank: r for r in reports}
    # a rank that died by a signal wrote no report; the others then lose contact with it
    # (SIGTERM is left out: it is how torchrun stops the remaining ranks)
    deaths = [(rank, -code) for rank, code in failures
              if code < 0 and rank not in by_rank and -code != signal.SIGTERM]
    root = failures[0] if failures else None
    if deaths and ((root is not None and deaths[0][0] == root[0])
                   or all(r.kind == "comm" for r in reports)):
        return RunFailure(_killed(*deaths[0], log_file))
    if reports:
        first = by_rank.get(root[0]) if root else None
        best = min(reports, key=lambda r: KINDS.index(r.kind))
        # a rank's lost contact, or its share of a failed collective checkpoint save, is
        # the consequence of another rank's failure: the report of the cause explains it
        chosen = first if first is not None and first.kind not in ("comm", "checkpoint") \
            else best
        if chosen.kind == "comm":
            return TransientError(chosen.message)
        suffix = f" (workers' log: {log_file})" if chosen.kind in ("crash", "checkpoint") else ""
        return RunFailure(chosen.message + suffix)
    if any(marker in torchrun_log for marker in _RDZV):
        return TransientError(_rendezvous(dist, torchrun_log))
    return None


def _killed(rank: int, signum: int, log_file: Path) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = {
        "SIGKILL": " (on Linux most often the kernel's out-of-memory killer: `dmesg | grep -i "
                   "oom` says; lower training.per_device_train_batch_size or "
                   "data.max_seq_length, or give the job more memory)",
        "SIGSEGV": " (a crash in native code: see the workers' log)",
        "SIGBUS": " (a crash in native code or a full /dev/shm: see the workers' log)",
    }.get(name, "")
    return (f"rank {rank} was killed by {name}{why}; torchrun stopped the other ranks; "
            f"{INTACT}; {RESUME} (workers' log: {log_file})")


def _rendezvous(dist: DistributedConfig, log: str) -> str:
    timed_out = "RendezvousTimeoutError" in log or "timed out" in log.lower()
    what = (f"timed out after distributed.rdzv_timeout {dist.rdzv_timeout} s" if timed_out
            else "could not be reached")
    return (f"the rendezvous at {dist.rdzv_endpoint} (rdzv_id {dist.rdzv_id}) {what}: start the "
            f"train stage on all {dist.nnodes} nodes with the same distributed.rdzv_endpoint and "
            "rdzv_id, node_rank 0 on the host of the endpoint, and check that its port is "
            "reachable from every node; nothing was written")
