"""One exception type for every user-facing failure.

Stages raise `PipelineError` with a message that names the file, key or row, what is wrong and
what to do. The CLI prints it as a single line and exits non-zero; `--debug` shows the traceback.
Anything else that escapes is a bug, and the CLI says so. Something the run works around (a
corrupt checkpoint skipped) is one `warning:` line on stderr, in the same form (`warn`).
"""

import logging
import sys

#: libraries that log at import what a user cannot act on: torchao's optional kernels built for
#: another Python (imported by peft whenever torchao is installed), torch's pytree deprecation
#: notes for torchao's enums. Errors from them still show.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


class PipelineError(Exception):
    """A failure caused by the user's input or environment, explained in one line."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # keep it on one line


class TransientError(PipelineError):
    """A failure worth retrying (network, hub): orchestrators retry these, not bad input."""

    exit_code = 75  # EX_TEMPFAIL


def warn(message: str) -> None:
    """One `warning: ...` line on stderr (not a Python warning with a source path and line)."""
    print("warning: " + " ".join(message.split()), file=sys.stderr, flush=True)


def quiet_import_noise() -> None:
    """Keep library import chatter (IMPORT_NOISE) off stderr, so our one-line messages are what a
    user reads; called first by every entry point (the CLI, the torchrun worker)."""
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
