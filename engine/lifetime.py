"""Processes that die with their parent, whatever kills it.

torchrun starts its workers in their own sessions, so a scheduler cancel, a CI timeout or a
`kill -- -PGID` of the train stage used to leave the workers training on and writing
checkpoints and outputs with no stage (and no workspace lock) around them. On Linux the kernel
can deliver a signal to a process when its parent dies (prctl PR_SET_PDEATHSIG): the stage sets
it for the torchrun agent (SIGTERM: torchrun then stops its workers), and every worker sets it
for itself (SIGKILL when the agent is gone). Elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits; if the parent is
    already gone (we were re-parented before asking), exit now. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:
        os._exit(128 + int(sig))
    return True


def child_dies_with_us(sig: int = signal.SIGTERM):
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when this process dies."""
    return lambda: die_with_parent(sig)
