"""What went wrong on a rank, in one line that names the cause and what to do.

A worker that fails writes a report (kind + line) for the launching stage, which picks the one
that explains the failure (tasks/launch_failure.py): bad input first, then the rank that died
first, then a resource running out, then the others' lost-contact errors (which are usually a
consequence). Outputs are written atomically (staging folder, then a rename), so every
message can say that the earlier checkpoints and outputs are intact.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from finetune.errors import PipelineError
from finetune.files import disk_full_error, exception_chain, refused_write

#: the kinds, in the order the launcher prefers them when several ranks report
KINDS = ("input", "disk", "memory", "crash", "checkpoint", "comm")

INTACT = "earlier checkpoints and outputs are intact"
CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
#: lower case: matched against the lower-cased error text
COMM = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
        "nccl communicator was aborted", "processgroupgloo", "processgroupnccl", "recvbytes",
        "sendbytes")


@dataclass(frozen=True)
class Report:
    kind: str
    message: str
    rank: int

    def write(self, directory: Path) -> None:
        path = directory / f"rank-{self.rank:05d}.json"
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read_all(cls, directory: Path) -> list["Report"]:
        found = []
        for path in sorted(directory.glob("rank-*.json")):
            try:
                found.append(cls(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return found


def _text(exc: BaseException) -> str:
    return "\n".join(f"{type(e).__name__}: {e}" for e in exception_chain(exc))


def _first_line(exc: BaseException) -> str:
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {line[:200]}"


def describe(exc: BaseException, rank: int, ddp_timeout: int | None = None) -> Report:
    """Classify an exception raised on `rank` into a report with its one line
    (`ddp_timeout`: the run's collective timeout, named when one expired)."""
    text = _text(exc)
    if isinstance(exc, PipelineError):
        return Report("input", str(exc), rank)
    ranks = rank_errors(exc)
    full = next((e for e in [exc, *ranks.values()]
                 if any(disk_full_error(x) for x in exception_chain(e))), None)
    if full is not None:
        where = getattr(exc, "filename", None) or getattr(full, "filename", None)
        at = f" writing {where}" if where else ""
        return Report("disk", (
            f"disk full{at} (rank {rank}): free space on that filesystem, lower "
            f"checkpoint.save_total_limit, or move the project to a larger disk, then run "
            f"again with checkpoint.resume_from_checkpoint: true; {INTACT}"), rank)
    refused = refused_write(exc)
    if refused is not None:
        return Report("disk", (
            f"cannot write {refused.filename or 'the output folder'} (rank {rank}): "
            f"{refused.strerror}; make that folder writable (chmod u+w, or remount the "
            "filesystem read-write) or move the project to a writable disk, then run again "
            f"with checkpoint.resume_from_checkpoint: true; {INTACT}"), rank)
    memory = _out_of_memory(exc, text)
    if memory:
        return Report("memory", (
            f"{memory} on rank {rank}: lower training.per_device_train_batch_size (raise "
            "gradient_accumulation_steps to keep the global batch), set "
            "training.gradient_checkpointing: true, or shard with distributed.strategy: "
            f"fsdp2; {INTACT}"), rank)
    if _is_comm(exc, text):
        if "timed out" in text.lower() or "timeout" in text.lower():
            after = f" after distributed.ddp_timeout {ddp_timeout} s" if ddp_timeout else ""
            return Report("comm", (
                f"rank {rank} timed out{after} waiting for the other ranks "
                f"({_first_line(exc)}): a rank hung (a stuck data loader, a deadlock, a "
                "slow disk) or died; raise distributed.ddp_timeout if a step legitimately "
                f"takes that long; {INTACT}; rerun with checkpoint.resume_from_checkpoint: "
                "true"), rank)
        return Report("comm", (
            f"rank {rank} lost contact with the other ranks ({_first_line(exc)}): another "
            "process died or hung, or the network between nodes failed; the log of the "
            f"first rank that failed says why; {INTACT}; rerun with "
            "checkpoint.resume_from_checkpoint: true"), rank)
    if ranks:  # DCP's wrapper: the rank's own error, and that the save failed on others too
        own = ranks.get(rank, next(iter(ranks.values())))
        return Report("checkpoint", (
            f"training crashed on rank {rank} in a checkpoint save that failed on ranks "
            f"{', '.join(map(str, sorted(ranks)))}: {_first_line(own)}"), rank)
    return Report("crash", f"training crashed on rank {rank}: {_first_line(exc)}", rank)


def rank_errors(exc: BaseException) -> dict[int, BaseException]:
    """torch.distributed.checkpoint's CheckpointException gathers every failing rank's own
    exception (`failures`: rank -> (exception, traceback)); its text names only the ranks.
    Those exceptions by rank, or {} for any other error."""
    for e in exception_chain(exc):
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            return {r: pair[0] for r, pair in failures.items()
                    if isinstance(pair, tuple) and isinstance(pair[0], BaseException)}
    return {}


def _out_of_memory(exc: BaseException, text: str) -> str | None:
    import torch

    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in text:
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(device)
            return (f"CUDA out of memory (GPU {device}: {(total - free) / 2**30:.1f} of "
                    f"{total / 2**30:.1f} GiB in use)")
        return "CUDA out of memory"
    if isinstance(exc, MemoryError) or any(s in text for s in CPU_OOM):
        return f"out of CPU memory ({_first_line(exc)})"
    return None


def _is_comm(exc: BaseException, text: str) -> bool:
    import torch.distributed as dist

    lower = text.lower()
    return isinstance(exc, dist.DistError) or any(s in lower for s in COMM)
