"""The stream manifest (`stream.json`): what identifies a streamed train split.

A streamed split is no DVC output, so the download stage writes this manifest (source, file
hashes, sampling settings) into `data/raw`, and format and tokenize carry it on with the
settings they apply, so that `data/tokenized` (the train stage's DVC dependency) changes
whenever the stream would. Kept apart from tasks.stream, which opens the stream with the
format and tokenize stages' functions, so those stages import no module that imports them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.files import write_json_atomic

MANIFEST = "stream.json"


def write_manifest(staging: Path, manifest: dict[str, Any]) -> None:
    write_json_atomic(staging / MANIFEST, manifest)


def carry_manifest(previous: Path, staging: Path, **applied: Any) -> None:
    """Format and tokenize pass the manifest on with the settings they apply to the stream, so
    `data/tokenized` (the train stage's DVC dependency) changes whenever the stream would."""
    src = previous / MANIFEST
    if src.exists():
        write_manifest(staging, {**json.loads(src.read_text()), **applied})
