"""Sharded checkpoints (torch.distributed.checkpoint) that survive a crash mid-save.

Layout of `<dir>/step-0000050/`:
- `.metadata`, `__<rank>_0.distcp`: DCP files with the trainable weights and optimizer state(s),
  FQN-keyed and sharded the way the model is (FSDP2 shards, DDP writes replicated tensors once);
- `rank-<r>.pt`: each rank's RNG states (dropout differs per rank); resumed on more processes,
  a rank without a file gets a state derived from (seed, rank, step) (`derived_rng_state`);
- `trainer.pt`: scheduler, GradScaler, strategy extras and the metric history (rank 0);
- `meta.json`, written last: data position (with the epoch's global sample count), world
  size, strategy, SHA-256 of every file, and `meta_sha256`, the SHA-256 of the rest of
  meta.json itself (a flipped step or position is detected like a corrupted shard).

All ranks write into one hidden staging folder, which rank 0 renames into place once everything
is on disk, so a crash mid-save leaves the previous checkpoint valid. A half-written or corrupted
checkpoint fails its hashes on load and the previous one is used, with a warning. Rotation keeps
the newest `save_total_limit` by step, or, with a metric, the newest plus the best. The folder
must be on storage all nodes share, unless save_on_each_node gives each node a whole copy of its
own (written and read through a node-local process group).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from finetune.errors import warn
from finetune.files import discard_on_failure, file_sha256, replace_dir

PREFIX = "step-"
META = "meta.json"
TRAINER = "trainer.pt"


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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_ok():
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _leads(group) -> bool:
    """Does this rank own the folder: rank 0, or with per-node groups its node's first rank."""
    return (dist.get_rank(group) if group is not None else _rank()) == 0


def save(directory: Path, step: int, dcp_state: dict, trainer_state: dict,
         meta: dict[str, Any], keep: int | None,
         best_by: tuple[str, bool] | None = None, preserve_best: int | None = None,
         group=None) -> Path:
    """Collective: every rank calls it with its share; returns the final folder.
    `best_by` = (metric key in meta, higher wins) makes rotation keep the best ones;
    `preserve_best`: that many best ones on top of the newest `keep`. `group`: this node's
    ranks (save_on_each_node): each node writes a whole checkpoint into its own folder."""
    rank, leader = _rank(), _leads(group)
    final = directory / f"{PREFIX}{step:07d}"
    staging = directory / f".{final.name}.tmp"
    if leader:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    _barrier()
    # a half-written checkpoint must not keep the space; the leader owns the folder
    with discard_on_failure(staging, remove=leader):
        with _single_process_ok():
            dcp.save(dcp_state, storage_writer=_ReproducibleWriter(str(staging)),
                     process_group=group)
        for r, state in _rng_files(rank, group, leader):
            _torch_save(state, staging / f"rank-{r:05d}.pt")
        _barrier()
        if leader:
            _torch_save(trainer_state, staging / TRAINER)
            files = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
            # no save time: the same run writes the same bytes (reruns compare byte for byte)
            meta = {**meta, "step": step, "files": files}
            meta[META_HASH] = _meta_digest(meta)
            (staging / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
            _fsync_dir(staging)
            replace_dir(staging, final)
            _fsync_dir(directory)
    if leader and keep:
        for stale in stale_checkpoints(directory, keep, best_by, preserve_best):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


class _ReproducibleWriter(dcp.FileSystemWriter):
    """DCP's file writer, minus what made the same save differ in bytes: its `.metadata`
    recorded the staging folder's absolute path and a fresh uuid (`storage_meta`:
    checkpoint_id, save_id). Loading needs neither (it makes its own), and a rerun of the same
    params must write the same bytes (an exact resume is checked byte for byte)."""

    def storage_meta(self):
        return None


def _rng_files(rank: int, group, leader: bool) -> list[tuple[int, dict]]:
    """The rank files this process writes: its own; with per-node copies (`group`), the
    node's first rank writes every rank's, gathered: a c10d rendezvous orders the nodes as
    they join, so after a restart a node may hold other global ranks than when it saved."""
    if group is None or not dist.is_initialized():
        return [(rank, rng_state())]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return list(enumerate(states)) if leader else []


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save through a Python file: a full disk raises OSError(ENOSPC) (saving to a
    path raises an opaque 'unexpected pos' RuntimeError instead)."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)


def _ranked(paths: list[Path], best_by: tuple[str, bool]) -> list[Path]:
    """Checkpoints that carry the metric, best first (ties: the earlier one)."""
    metric, higher_wins = best_by
    scored = [(meta[metric], i, p) for i, p in enumerate(paths)
              if (meta := read_meta(p) or {}).get(metric) is not None]
    scored.sort(key=lambda t: (-t[0] if higher_wins else t[0], t[1]))
    return [p for _, _, p in scored]


def stale_checkpoints(directory: Path, keep: int,
                      best_by: tuple[str, bool] | None = None,
                      preserve_best: int | None = None) -> list[Path]:
    """What rotation deletes: all but the newest `keep`; with `best_by` (metric, higher
    wins) all but the newest one (resume needs it) and the best `keep - 1` (at least one);
    with `preserve_best` too, all but the newest `keep` and the best `preserve_best`."""
    paths = list_checkpoints(directory, validate=False)
    if best_by is None:
        return paths[:-keep]
    if preserve_best:
        kept = set(paths[-keep:]) | set(_ranked(paths, best_by)[:preserve_best])
        return [p for p in paths if p not in kept]
    kept = set(paths[-1:]) | set(_ranked(paths, best_by)[: max(keep - 1, 1)])
    return [p for p in paths if p not in kept]


def best(directory: Path, best_by: tuple[str, bool]) -> Path | None:
    """The valid checkpoint with the best metric."""
    return next((p for p in _ranked(list_checkpoints(directory), best_by)), None)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None


META_HASH = "meta_sha256"


def _meta_digest(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != META_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _meta_intact(meta: dict[str, Any]) -> bool:
    # checkpoints written before meta.json carried its own hash have no META_HASH
    return meta.get(META_HASH, _meta_digest(meta)) == _meta_digest(meta)


def is_valid(path: Path) -> bool:
    return problem(path) is None


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed (said in the warning that skips it),
    or None when it is whole."""
    meta = read_meta(path)
    if meta is None:
        return "no readable meta.json: its save did not finish"
    files = meta.get("files")
    if not files or not _meta_intact(meta):
        return "its meta.json fails its own SHA-256"
    for name, digest in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if file_sha256(path / name) != digest:
            return f"{name} fails its SHA-256 check"
    return None


def _skip(path: Path, why: str) -> None:
    warn(f"checkpoint {path} is incomplete or corrupt ({why}); skipping it")


def list_checkpoints(directory: Path, validate: bool = True) -> list[Path]:
    """Checkpoints oldest -> newest, by step: one folder holds one run's checkpoints (a fresh
    run sets the earlier ones aside, a resume by path the later ones), so a later step is a
    later save. Invalid ones are skipped (with a warning)."""
    if not directory.exists():
        return []
    found = []
    for path in directory.glob(f"{PREFIX}*"):
        if not path.is_dir():
            continue
        if validate and (why := problem(path)) is not None:
            _skip(path, why)
            continue
        found.append((_step_of(path) or 0, path))
    return [p for _, p in sorted(found)]


def latest(directory: Path) -> Path | None:
    """The newest valid checkpoint. Hashes are checked newest-first, so a resume reads only
    the checkpoint it uses (and any corrupt newer ones), not every kept checkpoint."""
    for path in reversed(list_checkpoints(directory, validate=False)):
        why = problem(path)
        if why is None:
            return path
        _skip(path, why)
    return None


def newest_meta(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint whose meta.json is intact, without hashing its files: what a
    launcher may check before it starts any process (world size, strategy)."""
    for path in reversed(list_checkpoints(directory, validate=False)):
        meta = read_meta(path)
        if meta and _meta_intact(meta):
            return path, meta
    return None


PREVIOUS = ".previous"


def set_aside(directory: Path, keep_runs: int,
              after_step: int | None = None) -> tuple[Path | None, list[Path]]:
    """Move every checkpoint in `directory` (and staging leftovers; with `after_step`, only
    those of later steps) to `<directory>.previous/<UTC time>` so a run never mixes with
    another's; delete all but the newest `keep_runs` such sets (0: nothing is kept). Returns
    (where they went or None, the sets deleted)."""
    entries = [p for p in directory.iterdir() if p.name.startswith((PREFIX, f".{PREFIX}"))] \
        if directory.exists() else []
    if after_step is not None:
        entries = [p for p in entries if _step_of(p) is None or _step_of(p) > after_step]
    if not entries:
        return None, []
    parent = directory.with_name(directory.name + PREVIOUS)
    target = parent / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffix = 1
    while target.exists():
        target, suffix = target.with_name(f"{target.name.split('-')[0]}-{suffix}"), suffix + 1
    target.mkdir(parents=True)
    for entry in entries:  # a move, not a rename: the folder may be a mount of its own
        shutil.move(entry, target / entry.name)
    sets = sorted(p for p in parent.iterdir() if p.is_dir())
    doomed = sets[:-keep_runs] if keep_runs else sets
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)
    return (None if keep_runs == 0 else target), doomed


def _step_of(path: Path) -> int | None:
    """The step in a checkpoint folder's name (step-0000008, .step-0000008.tmp)."""
    digits = path.name.lstrip(".").removeprefix(PREFIX).split(".")[0]
    return int(digits) if digits.isdigit() else None


def load(path: Path, dcp_state: dict, apply: Callable[[dict], None],
         group=None) -> tuple[dict, dict]:
    """Collective: fill `dcp_state` in place from `path`, hand it to `apply`, restore this
    rank's RNG last (loading must not consume random numbers after it); returns
    (trainer_state, meta). `group`: this node's ranks, reading this node's own copy."""
    with _single_process_ok():
        dcp.load(dcp_state, checkpoint_id=str(path), process_group=group)
    apply(dcp_state)
    trainer_state = torch.load(path / TRAINER, map_location="cpu", weights_only=False)
    meta = read_meta(path) or {}
    own = path / f"rank-{_rank():05d}.pt"
    set_rng_state(torch.load(own, weights_only=False) if own.is_file()
                  else derived_rng_state(meta.get("seed") or 0, _rank(), meta.get("step", 0)))
    return trainer_state, meta


def derived_rng_state(seed: int, rank: int, step: int) -> dict[str, Any]:
    """The RNG state of a rank the checkpoint has no file for (it resumes on more processes
    than wrote it): drawn from (seed, rank, step), so it is reproducible, differs from every
    other rank's and from a fresh run's. Ranks that did write keep their own stream."""
    value = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    saved = rng_state()
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # every CUDA device too
    state = rng_state()
    set_rng_state(saved)
    return state
