"""Processes that die with their parent, whatever kills it.

torchrun starts its workers in their own sessions, so a scheduler cancel, a CI timeout or a
`kill -- -PGID` of the train stage used to leave the workers training on and writing
checkpoints and outputs with no stage (and no workspace lock) around them. On Linux the kernel
can deliver a signal to a process when its parent dies (prctl PR_SET_PDEATHSIG): the stage sets
it for the torchrun agent (SIGTERM: torchrun then stops its workers), and every worker sets it
for itself (SIGKILL when the agent is gone). Where the kernel has no such signal (macOS,
Windows), a watchdog thread polls the parent and the pid named in `FINETUNE_WATCH_PID` (the
train stage's own pid, which the launcher exports to its workers) and ends the process when
either is gone.

Under an orchestrator (the Prefect task runs `dvc repro`, which runs the stage) the chain is
task -> dvc -> [shell] -> stage -> torchrun -> workers. dvc runs a cmd as `$SHELL -c cmd`:
bash execs the command, but dash (Debian's /bin/sh, and dvc's shell when SHELL is unset) stays
as the stage's parent and outlives a killed dvc. So the task starts dvc dying with it (kernel),
and names its own pid in `FINETUNE_EXIT_WITH`: the stage dies with its parent and with that
pid, whatever stands between them; a cancelled or killed task leaves no training behind. A
stage started from a shell does not bind itself: `nohup` must keep it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


WATCH_PID = "FINETUNE_WATCH_PID"
EXIT_WITH = "FINETUNE_EXIT_WITH"


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits; if the parent is
    already gone (we were re-parented before asking), exit now. Where the kernel cannot, a
    watchdog thread does it (and also watches `FINETUNE_WATCH_PID`). True when the kernel
    took it."""
    parent = os.getppid()
    if _kernel_parent_death_signal(sig, parent):
        return True
    watched = [int(os.environ[WATCH_PID])] if os.environ.get(WATCH_PID, "").isdigit() else []
    start_watchdog(parent, watched, sig)
    return False


def _kernel_parent_death_signal(sig: int, parent: int) -> bool:
    """PR_SET_PDEATHSIG on Linux (False elsewhere); exits at once if `parent` is already gone
    (we were re-parented before asking)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:
        os._exit(128 + int(sig))
    return True


def start_watchdog(parent: int, pids: list[int], sig: int = signal.SIGKILL,
                   interval: float = 0.5) -> threading.Thread:
    """A daemon thread that ends this process (`sig`, then a hard exit) once its parent
    changes (it died and we were re-parented) or any of `pids` no longer exists."""

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)  # PermissionError: it exists, owned by someone else
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def watch() -> None:
        while os.getppid() == parent and not any(gone(pid) for pid in pids):
            time.sleep(interval)
        try:
            os.kill(os.getpid(), sig)
        finally:
            os._exit(128 + int(sig))

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def bind_to_orchestrator_if_asked() -> None:
    """The stage process, when its launcher (the orchestrator's dvc runner) named its own pid
    in FINETUNE_EXIT_WITH: SIGTERM when our parent dies (kernel) or that pid is gone (a
    watchdog: a shell may stand between dvc and us, and nothing ends it when dvc dies)."""
    pid = os.environ.get(EXIT_WITH, "")
    if not pid.isdigit():
        return
    _kernel_parent_death_signal(signal.SIGTERM, os.getppid())  # where it cannot: the watchdog
    start_watchdog(os.getppid(), [int(pid)], signal.SIGTERM)


def child_dies_with_us(sig: int = signal.SIGTERM):
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when this process dies
    (Linux; a watchdog thread started between fork and exec would not survive the exec, so
    elsewhere the child's own code must watch: the workers do, through die_with_parent)."""
    parent = os.getpid()
    return lambda: _kernel_parent_death_signal(sig, parent)
