"""One exception type for every user-facing failure.

Stages raise `PipelineError` with a message that names the file, key or row, what is wrong and
what to do. The CLI prints it as a single line and exits non-zero; `--debug` shows the traceback.
Anything else that escapes is a bug, and the CLI says so. Something the run works around (a
corrupt checkpoint skipped) is one `warning:` line on stderr, in the same form (`warn`).
"""

import logging
import os
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


#: the environment variables that keep the Hugging Face clients off the network
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_unreachable(key: str, name: str, exc: Exception, instead: str, verb: str = "load",
                    retry_online: bool = True) -> PipelineError:
    """The one error for a Hugging Face Hub name (a model, a dataset) that did not load: bad
    input when the clients are offline (it is not in the local cache), else worth a retry
    (a TransientError; `retry_online` False where an online failure may as well be a name
    that does not exist). `instead`: the local alternative, e.g. "point model.name_or_path at
    a local folder"."""
    if any(os.environ.get(v) for v in OFFLINE_VARIABLES):
        why, error = "HF_HUB_OFFLINE is set and it is not in the local cache", PipelineError
    else:
        why = ("the Hugging Face Hub could not be reached or has no such repo "
               f"({type(exc).__name__})")
        error = TransientError if retry_online else PipelineError
    return error(f"{key} '{name}': cannot {verb}: {why}; with network access unset "
                 f"HF_HUB_OFFLINE, or {instead}")


def warn(message: str) -> None:
    """One `warning: ...` line on stderr (not a Python warning with a source path and line)."""
    print("warning: " + " ".join(message.split()), file=sys.stderr, flush=True)


def quiet_import_noise() -> None:
    """Keep library import chatter (IMPORT_NOISE) off stderr, so our one-line messages are what a
    user reads; called first by every entry point (the CLI, the torchrun worker)."""
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
