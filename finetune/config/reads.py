"""Which params keys a stage reads: what keeps dvc.yaml's per-stage params lists honest.

DVC reruns a stage only when a key listed under its `params` changes, so a key a stage reads
but does not list is a stale output waiting to happen. With `FINETUNE_CONFIG_READS=<folder>`
set, every process records each leaf key it reads from the moment `start(stage)` is called
(after validation, whose checks read everything) and writes them to
`<folder>/<stage>-<pid>.json` at exit. `finetune stage NAME` starts it for the stage, and the
torchrun workers inherit the stage's name (FINETUNE_STAGE), so the train stage's reads include
the engine's. tests/test_pipeline.py runs `dvc repro` with it on and compares.
"""

from __future__ import annotations

import atexit
import json
import os
import typing
from pathlib import Path

ENV_DIR = "FINETUNE_CONFIG_READS"
ENV_STAGE = "FINETUNE_STAGE"

_reads: set[str] | None = None
_paths: dict[type, str] | None = None
_root: type | None = None


def start(stage: str | None = None) -> None:
    """Record from now on, if FINETUNE_CONFIG_READS names a folder (else a no-op)."""
    global _reads
    folder = os.environ.get(ENV_DIR)
    if not folder or _reads is not None:
        return
    if stage:
        os.environ[ENV_STAGE] = stage  # children (torchrun workers) report under it
    _reads = set()
    label = os.environ.get(ENV_STAGE, "unknown")
    atexit.register(_write, Path(folder) / f"{label}-{os.getpid()}.json")


def _write(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sorted(_reads or ())))


def register_root(root: type) -> None:
    """The schema's top-level class (called by finetune.config.schema): a field read is
    named by where its section class sits under it."""
    global _root
    _root = root


def _section_paths() -> dict[type, str]:
    """Section class -> its dotted place in the config (each class sits in one place)."""
    from pydantic import BaseModel

    found: dict[type, str] = {}

    def walk(model, prefix: str) -> None:
        for name, field in model.model_fields.items():
            for sub in typing.get_args(field.annotation) or (field.annotation,):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    found[sub] = f"{prefix}{name}"
                    walk(sub, f"{prefix}{name}.")

    walk(_root, "")
    return found


def note(section: type, name: str) -> None:
    """Called by Section on every field read while recording."""
    global _paths
    if _paths is None:
        _paths = _section_paths()
    prefix = _paths.get(section)
    if prefix is not None:
        _reads.add(f"{prefix}.{name}")


def recording() -> bool:
    return _reads is not None
