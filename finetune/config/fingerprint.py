"""Which config keys decide a run's trajectory: the config part of a checkpoint's fingerprint.

The rest of the fingerprint (content hashes of the train data and the base model) and the
resume decision are the engine's (engine.state.fingerprint, engine.state.trainer_state); which keys
count is a fact about each key, declared on its field (`Field(..., fingerprint=True)`,
finetune/config/section.py) and read off the schema here, so a new section's keys need no edit
to this module. A sub-section's field may leave the whole sub-section out (the schema's
`logging`, `checkpoint`, `eval`, `export`, `registry` and `data`, whose `max_seq_length` says
True on its own field). Left out, as docs/reliability.md lists them: bookkeeping, what the
content hashes identify (the train examples, the base model), speed and memory levers with the
same math, what is measured and printed, launcher plumbing.
"""

from __future__ import annotations

from typing import Any

from finetune.config.section import fact, fields_of, flatten

#: every key of the schema (leaves and sub-sections) -> its decision: its own field's fact,
#: else the nearest enclosing sub-section field's; None: undecided (filled by register_root)
_DECISIONS: dict[str, bool | None] = {}
#: the leaf keys that decide a run's trajectory, each by its own field's `fingerprint=True`
IN_FINGERPRINT: tuple[str, ...] = ()
#: the leaf keys left out, by their own field or an enclosing sub-section's
NOT_IN_FINGERPRINT: tuple[str, ...] = ()


def register_root(root: type) -> None:
    """Classify every key of the schema's top-level class (called by finetune.config.schema,
    which this module cannot import: the schema's rows ask it which keys count)."""
    global IN_FINGERPRINT, NOT_IN_FINGERPRINT
    decided: dict[str, bool | None] = {}
    own: dict[str, bool | None] = {}
    leaves = []
    for key, field, is_section in fields_of(root):
        parent = decided.get(key.rpartition(".")[0]) if "." in key else None
        own[key] = fact(field, "fingerprint")
        decided[key] = parent if own[key] is None else own[key]
        if not is_section:
            leaves.append(key)
    _DECISIONS.clear()
    _DECISIONS.update(decided)
    IN_FINGERPRINT = tuple(k for k in leaves if own[k] is True)
    NOT_IN_FINGERPRINT = tuple(k for k in leaves if decided[k] is False)


def counts(key: str) -> bool:
    """Is this dotted config key part of the fingerprint? A key inside a mapping value
    (`optimizer.kwargs.betas`) is its field's; an undecided key counts (tests/test_key_lists.py
    leaves none)."""
    probe = key
    while probe not in _DECISIONS and "." in probe:
        probe = probe.rpartition(".")[0]
    decided = _DECISIONS.get(probe)
    return True if decided is None else decided


def config_part(cfg: Any) -> dict[str, Any]:
    """`cfg`: a FinetuneConfig (not imported: the schema imports this module)."""
    flat = flatten(cfg.model_dump(mode="json"))
    part = {k: v for k, v in flat.items() if counts(k)}
    # how the global batch is split (micro-batch x accumulation x processes) is not the math:
    # the loss is token-weighted over the whole step and the data order is global, so only
    # the product counts and a checkpoint resumes on another world size (docs/reliability.md)
    for key in SPLIT_KEYS:
        part.pop(f"training.{key}", None)
    part[GLOBAL_BATCH] = global_batch(cfg)
    strategy = cfg.distributed.resolved_strategy
    part["distributed.strategy"] = RESHARDABLE_LABEL if strategy in RESHARDABLE else strategy
    return part


#: the keys whose product with the world size is the global batch
SPLIT_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps")
#: the fingerprint's name for examples per optimizer step, all processes together
GLOBAL_BATCH = "training.global_batch_size"
#: strategies whose checkpoints DCP reshards onto any world size: the same math (every rank's
#: gradient averaged each step), one fingerprint value, so each may resume the others'
RESHARDABLE = ("single", "ddp", "fsdp2")
RESHARDABLE_LABEL = "single|ddp|fsdp2"


def batch_split(cfg: Any) -> dict[str, int]:
    """How `cfg` splits its global batch: what a refusal of another global batch names."""
    t = cfg.training
    return {"per_device_train_batch_size": t.per_device_train_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps,
            "world_size": cfg.distributed.world_size}


def global_batch(cfg: Any) -> int:
    split = batch_split(cfg)
    return (split["per_device_train_batch_size"] * split["gradient_accumulation_steps"]
            * split["world_size"])


#: the content-hash parts of the fingerprint, named like config keys in refusals
CONTENT_KEYS = ("train_data", "base_model", "user_code")
