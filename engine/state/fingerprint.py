"""Which run a checkpoint belongs to: the fingerprint of everything that decides the trajectory.

A checkpoint continues one run: resuming it under other params (a new learning rate, other
data, another base model) gives the old run's weights while the params file, dvc.lock and
MLflow record the new ones. So every checkpoint records a fingerprint and resume compares it
with the fingerprint of the run about to start (engine.state.trainer_state.plan_start):

- `config`: the resolved config as dotted keys, minus `NOT_IN_FINGERPRINT`: keys that do not
  change the math (logging cadence, checkpoint and eval settings, export, loader workers,
  compile and gradient-checkpointing switches, launcher plumbing) and keys whose effect is
  already in a content hash below (the data section's dataset and template keys; the model's
  path). The world size is not: the global batch size (micro-batch x accumulation x world
  size) is, and single, ddp and fsdp2 share one strategy value, so a checkpoint resumes on
  another number of processes as long as each step sees as many examples.
- `batch`: how the global batch was split (not compared: what a refusal names).
- `train_data`: SHA-256 of the train examples: the tokenized split's Arrow files, or the
  stream manifest of a streamed split (source file hashes and sampling settings).
- `base_model`: SHA-256 of the base model's config and weight files for a local folder; for a
  hub id, the commit the cache resolved it to.
- `user_code`: SHA-256 of the file of each tool, environment, reward function and other
  'module:name' the params name (finetune.user_code), by key: the params hold only the
  reference, so an edited environment would otherwise resume as the same run.

Hashing a 15 GB model costs seconds, so file hashes are cached by (path, size, mtime, inode)
in `$FINETUNE_CACHE_DIR` (default `~/.cache/finetune`), as DVC caches its own.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from engine.modeling.model import resolve_model_ref
from engine.process.job import RunPaths
from finetune.config import FinetuneConfig
from finetune.config.fingerprint import (
    CONTENT_KEYS,
    GLOBAL_BATCH,
    RESHARDABLE,
    RESHARDABLE_LABEL,
    SPLIT_KEYS,
    batch_split,
    config_part,
    flatten,
)
from finetune.hashing import HashCache, data_hash_with
from finetune.user_code import code_hashes

MODEL_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def of_run(cfg: FinetuneConfig, paths: RunPaths) -> dict[str, Any]:
    """The fingerprint of the run `cfg` would train on `paths` (the worker's and the train
    stage's preflight: the same inputs, so the same value)."""
    return compute(cfg, paths.train_identity or paths.train_data,
                   resolve_model_ref(cfg.model.name_or_path, paths.project_root))


def compute(cfg: FinetuneConfig, train_identity: Path | None, model_ref: str) -> dict[str, Any]:
    """The fingerprint of a run about to start. `train_identity`: the tokenized train split
    (a folder) or the stream manifest (a file); `model_ref`: the resolved model path or hub id."""
    cache = HashCache.open()
    try:
        return {"config": config_part(cfg), "batch": batch_split(cfg),
                "train_data": data_hash_with(train_identity, cache),
                "base_model": _model_hash(model_ref, cfg.model.revision, cache),
                "user_code": code_hashes(cfg)}
    finally:
        cache.close()


def differences(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, str]:
    """What differs between a checkpoint's fingerprint and this run's: key -> 'old -> new'
    (config keys dotted; `train_data` and `base_model` for the content hashes)."""
    if not old:
        return {"fingerprint": "none recorded (a checkpoint from before fingerprints)"}
    found = {}
    before, after = _upgraded(old.get("config", {})), new["config"]
    defaults = _defaults()
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key, "<unset>"), after.get(key, "<unset>")
        if key not in before and key in defaults and defaults[key] == now:
            continue  # a key added since the checkpoint, at its default: the run it was
        if was != now:
            found[key] = f"{_short(was)} -> {_short(now)}"
    for key in CONTENT_KEYS:
        if key == "user_code":
            if key in old:  # a checkpoint from before user code was hashed has none
                edited = _edited(old[key], new[key])
                if edited:
                    found[key] = edited
        elif old.get(key) != new[key]:
            found[key] = "content changed"
    return found


@functools.cache
def _defaults() -> dict[str, Any]:
    """Dotted key -> default (as the fingerprint records values) of every section that has
    defaults for all its keys. A key added to the config keeps the behaviour from before it
    at its default, so a checkpoint recorded before it existed resumes under that default."""
    found: dict[str, Any] = {}
    for name, field in FinetuneConfig.model_fields.items():
        try:
            section = field.get_default(call_default_factory=True)
        except Exception:  # a section with required keys (data): no defaults to offer
            continue
        if hasattr(section, "model_dump"):
            found.update(flatten({name: section.model_dump(mode="json")}))
    return found


def _edited(old: dict[str, str], new: dict[str, str]) -> str | None:
    """Which user code references changed file content, or came or went: 'grpo.tools[0]
    content changed, ...'; None when none did."""
    changes = []
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            changes.append(f"{key} {'added' if key in new else 'removed'}")
        elif old[key] != new[key]:
            changes.append(f"{key} content changed")
    return ", ".join(changes) or None


def _upgraded(config: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint recorded before the global batch replaced the world size and its split
    (and before single, ddp and fsdp2 shared one strategy value), in today's terms: such a
    checkpoint still resumes, and on another world size too."""
    if GLOBAL_BATCH in config or "distributed.world_size" not in config:
        return config
    config = dict(config)
    split = [config.pop(f"training.{key}", None) for key in SPLIT_KEYS]
    world = config.pop("distributed.world_size")
    if None not in split:
        config[GLOBAL_BATCH] = split[0] * split[1] * world
    if config.get("distributed.strategy") in RESHARDABLE:
        config["distributed.strategy"] = RESHARDABLE_LABEL
    return config


def global_batch_refusal(path: Path, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """One line when the checkpoint's global batch differs from this run's, naming how each
    is split and which key would restore it; None when it is the same."""
    was, now = _upgraded(old.get("config", {})).get(GLOBAL_BATCH), new["config"][GLOBAL_BATCH]
    if was is None or was == now:
        return None
    split = new["batch"]
    return (f"checkpoint {path} has global batch {was}{_split_text(old.get('batch'))}; this "
            f"run's is {now}{_split_text(split)}: {_fix(was, split)} to resume")


def _split_text(split: dict[str, int] | None) -> str:
    if not split:
        return ""
    return (f" (per_device_train_batch_size {split['per_device_train_batch_size']} x "
            f"gradient_accumulation_steps {split['gradient_accumulation_steps']} x world size "
            f"{split['world_size']})")


def _fix(target: int, split: dict[str, int]) -> str:
    """The one key to change (accumulation first: it keeps the memory per process)."""
    micro, accum, world = (split[k] for k in (*SPLIT_KEYS, "world_size"))
    if target % (micro * world) == 0:
        return f"set training.gradient_accumulation_steps {target // (micro * world)}"
    if target % (accum * world) == 0:
        return f"set training.per_device_train_batch_size {target // (accum * world)}"
    if target % world == 0:
        return (f"set training.per_device_train_batch_size x gradient_accumulation_steps to "
                f"{target // world}")
    return f"resume on a number of processes that divides {target}"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _model_hash(ref: str, revision: str | None, cache: "HashCache") -> str:
    local = Path(ref)
    if local.is_dir():
        files = sorted(p for p in local.iterdir() if p.is_file() and (
            p.name == "config.json" or p.suffix in MODEL_FILES))
        h = hashlib.sha256()
        for path in files:
            h.update(f"{path.name}\0{cache.sha256(path)}\0".encode())
        return h.hexdigest()
    return f"hub:{ref}@{_hub_commit(ref, revision) or revision or 'main'}"


def _hub_commit(repo: str, revision: str | None) -> str | None:
    """The commit the local hub cache resolves `repo@revision` to (its snapshot folder)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - no cache entry or no hub library: name it by revision
        return None
    return Path(found).parent.name if isinstance(found, str) else None
