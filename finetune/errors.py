"""One exception type for every user-facing failure.

Stages raise `PipelineError` with a message that names the file, key or row, what is wrong and
what to do. The CLI prints it as a single line and exits non-zero; `--debug` shows the traceback.
Anything else that escapes is a bug, and the CLI says so. Something the run works around (a
corrupt checkpoint skipped) is one `warning:` line on stderr, in the same form (`warn`).
"""

import sys


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
