"""How a config value names a trained model: a registered model (`models:/NAME@alias`,
`models:/NAME/VERSION`, MLflow's registry URIs) or a model folder (a path with a '/').

One definition for every place that reads such a reference: the keys whose field is marked
`model_ref` (finetune.config.section.Field; walked by `model_refs`, resolved and checked by
tasks/model_refs.py, which then name no key and no method), the reward-function entries among
them (finetune.config.reward_refs) and `finetune reproduce MODEL_URI` (tasks/reproduce.py).
Before, the registry URI had two regexes that disagreed on what an alias may hold, and the
resolver read `grpo.reward_funcs` by name when `training.type` was grpo.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

from finetune.config.methods import reads_section
from finetune.config.section import model_ref_keys

#: a registered model: `models:/NAME@ALIAS` or `models:/NAME/VERSION`; an alias is what
#: MLflow's registry accepts for one (letters, digits, '_' and '-')
REGISTERED_MODEL = re.compile(
    r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[\w\-]+)|/(?P<version>\d+))")


def model_ref_kind(value: str) -> Literal["registered", "folder"] | None:
    """What a value names when it names a model: a registered model (`models:/...`, checked
    against REGISTERED_MODEL where it is validated), a folder (a path: it has a '/' and no
    ':', which would make it a `module:function` reference); None for anything else (a
    built-in's name, a function)."""
    if value.startswith("models:/"):
        return "registered"
    if ":" in value:
        return None
    return "folder" if "/" in value else None


@dataclass(frozen=True)
class ModelRef:
    """One model reference in the params: where it is, what it says, what it is for."""

    key: str  # the marked field's dotted key (grpo.reward_funcs)
    index: int | None  # its position in the key's list value; None: the value itself
    ref: str  # as written: models:/scorer@champion, ./rm
    role: str  # the field's model_ref fact (reward_model)

    @property
    def entry(self) -> str:
        """The reference's place as messages name it: `grpo.reward_funcs[1]`."""
        return self.key if self.index is None else f"{self.key}[{self.index}]"

    @property
    def kind(self) -> Literal["registered", "folder"]:
        return model_ref_kind(self.ref)


def model_refs(config) -> list[ModelRef]:
    """Every model reference in the keys marked `model_ref`, in key then list order: the
    values (or list elements) that name a model (`model_ref_kind`), not those that name
    something else in the same list. A key in a method's own section (a method's
    `Method.sections`) counts only when training.type is that method: another method's run
    never loads it, as before a method's section was read by name."""
    found: list[ModelRef] = []
    for key, role in model_ref_keys(type(config)):
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part) if value is not None else None
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        refs = [ModelRef(key, i, v, role) for i, v in items
                if isinstance(v, str) and model_ref_kind(v) is not None]
        if refs and reads_section(config.training.type, key.split(".")[0]):
            found += refs
    return found


def replaced(config, new: dict[ModelRef, str]):
    """A deep copy of `config` with each reference in `new` replaced by the value there (a
    registered model by its downloaded folder); each field is assigned once, its whole new
    value validated."""
    copy = config.model_copy(deep=True)
    for key in dict.fromkeys(ref.key for ref in new):
        *parents, name = key.split(".")
        owner = functools.reduce(getattr, parents, copy)
        value = getattr(owner, name)
        for ref, replacement in new.items():
            if ref.key != key:
                continue
            if ref.index is None:
                value = replacement
            else:
                value = list(value)
                value[ref.index] = replacement
        setattr(owner, name, value)
    return copy
