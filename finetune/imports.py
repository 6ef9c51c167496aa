"""`module:name` references: how a params file names user code (callbacks, model classes,
prompt functions) and how the launcher names the worker's stream source.

One loader so that every such key fails the same way: one line naming the key, the reference
and why it could not be imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from finetune.errors import PipelineError


def load_object(ref: str, key: str) -> Any:
    """'package.module:name' -> the object it names; a failure is one line naming `key`."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise PipelineError(f"{key}: '{ref}' must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineError(f"{key}: cannot import '{ref}' ({exc})") from None
    if not hasattr(module, attr):
        raise PipelineError(
            f"{key}: cannot import '{ref}' (module '{module_name}' has no attribute '{attr}')")
    return getattr(module, attr)
