"""Save and stop on a scheduler's signal before its time limit.

A batch scheduler can signal a job some minutes before it kills it. A job armed for that signal
(JobSpec.stop_signal) saves a normal checkpoint at the next optimizer-step boundary and leaves
cleanly (exit 0, no trained model, no final metrics), with a "stopped file" that tells its
batch script to requeue it; the requeued job resumes from that checkpoint with the ordinary
exact resume.

The signal may reach the ranks at different moments, or only some of them: at each step
boundary the ranks agree whether any rank got it (one MAX all-reduce of a 1-element CPU tensor
on a gloo group, so a CUDA run gets no device sync from it). The handler only sets a flag;
everything else happens in the loop, at a point every rank reaches in the same order.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from finetune.errors import PipelineError
from finetune.files import write_json_atomic


class StoppedBySignal(Exception):
    """Raised on every rank after the stop checkpoint is saved: the worker leaves with exit 0,
    skipping the run's end (trained model, final metrics), which a restart still has to reach."""

    def __init__(self, step: int, checkpoint: Path, signal_name: str):
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name
        super().__init__(f"[train] stopped at step {step} on {signal_name}: checkpoint "
                         f"{checkpoint} saved; a restart resumes from it")


def signal_number(name: str) -> signal.Signals:
    """'SIGUSR1' (or 'USR1') -> the signal; anything else is one line naming the job field."""
    full = name if name.upper().startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals[full.upper()]
    except KeyError:
        raise PipelineError(f"job stop_signal {name!r} is not a signal of this system; name one "
                            "such as SIGUSR1") from None


class StopSignal:
    """One rank's record of the stop signal: set by the handler, agreed on at step ends."""

    def __init__(self, name: str, stopped_file: str | None = None):
        self.signum = signal_number(name)
        self.name = self.signum.name
        self.stopped_file = Path(stopped_file) if stopped_file else None
        self.received = False
        self.world_size = 1
        self.group = None  # the default group (gloo) or a gloo group of all ranks

    def _handle(self, signum, frame) -> None:
        self.received = True

    def bind(self, world_size: int) -> None:
        """Once the process group exists (every rank, collectively when it is not gloo): the
        group the per-step agreement runs on."""
        self.world_size = world_size
        if world_size > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    def agreed(self) -> bool:
        """Did any rank get the signal? The same answer on every rank; a collective when
        there are several ranks, so every rank calls it at the same step boundary."""
        if self.world_size == 1:
            return self.received
        flag = torch.tensor([int(self.received)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def stopped(self, step: int, checkpoint: Path, is_main: bool) -> StoppedBySignal:
        """After the stop checkpoint: the main rank writes the stopped file (atomically, so
        a script never reads half of it); the exception every rank raises."""
        if is_main and self.stopped_file is not None:
            write_json_atomic(self.stopped_file, {"step": step, "checkpoint": str(checkpoint),
                                                  "signal": self.name})
        return StoppedBySignal(step, checkpoint, self.name)


_armed: StopSignal | None = None


def current() -> StopSignal | None:
    """The stop signal this process is armed for (None: the run ignores signals)."""
    return _armed


@contextlib.contextmanager
def armed(name: str | None, stopped_file: str | None = None) -> Iterator[StopSignal | None]:
    """Within: `name` sets the flag instead of its usual action (a signal handler belongs to
    the process, hence one armed record per process). Interrupted system calls restart, so a
    signal cannot break a collective's socket read. The earlier handler comes back after."""
    global _armed
    if name is None:
        yield None
        return
    stop = StopSignal(name, stopped_file)
    previous = signal.signal(stop.signum, stop._handle)
    signal.siginterrupt(stop.signum, False)
    _armed = stop
    try:
        yield stop
    finally:
        _armed = None
        signal.signal(stop.signum, signal.SIG_DFL if previous is None else previous)


def remove_stale_stopped_file(stopped_file: str | None) -> None:
    """The main rank at start: a stopped file an earlier attempt left must not make the batch
    script requeue this attempt when it ends."""
    if stopped_file:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stopped_file)
