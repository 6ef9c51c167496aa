"""Checkpoints that survive a crash mid-save and restore training exactly.

Layout: `<dir>/step-0000050/{state.pt, meta.json}`. A checkpoint is written into a hidden
staging folder and renamed into place; `meta.json` (written last) carries the SHA-256 of
`state.pt`, so a half-written or corrupted checkpoint is detected on load and the previous one
is used instead, with a warning. Rotation keeps the newest `save_total_limit` by save time, so a
fresh run's first checkpoints displace an older run's only once they exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.workspace import replace_dir

PREFIX = "step-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(directory: Path, step: int, state: dict[str, Any], meta: dict[str, Any],
         keep: int | None) -> Path:
    """Write `state` (tensors, optimizer, ...) and `meta` (json) as checkpoint `step`."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{step:07d}"
    staging = directory / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    torch.save(state, staging / "state.pt")
    meta = {**meta, "step": step, "saved_at_ns": time.time_ns(),
            "state_sha256": _sha256(staging / "state.pt")}
    (staging / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    _fsync_dir(staging)
    replace_dir(staging, final)
    _fsync_dir(directory)
    if keep:
        for stale in list_checkpoints(directory, validate=False)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def is_valid(path: Path) -> bool:
    meta = read_meta(path)
    state = path / "state.pt"
    return bool(meta) and state.exists() and _sha256(state) == meta.get("state_sha256")


def list_checkpoints(directory: Path, validate: bool = True) -> list[Path]:
    """Checkpoints oldest -> newest by save time; invalid ones skipped (with a warning)."""
    if not directory.exists():
        return []
    found = []
    for path in directory.glob(f"{PREFIX}*"):
        if not path.is_dir():
            continue
        if validate and not is_valid(path):
            warnings.warn(f"checkpoint {path} is incomplete or corrupt; skipping it", stacklevel=2)
            continue
        meta = read_meta(path) or {}
        found.append((meta.get("saved_at_ns", 0), path))
    return [p for _, p in sorted(found)]


def latest(directory: Path) -> Path | None:
    valid = list_checkpoints(directory)
    return valid[-1] if valid else None


def load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    return state, read_meta(path) or {}
