"""How a config value names a trained model: a registered model (`models:/NAME@alias`,
`models:/NAME/VERSION`, MLflow's registry URIs) or a model folder (a path with a '/').

One definition for every place that reads such a reference: the keys whose field is marked
`model_ref` (finetune.config.section.Field; walked by `model_refs`, resolved and checked by
tasks/model_refs.py), the reward-function entries among them (finetune.config.reward_refs) and
`finetune reproduce MODEL_URI` (tasks/reproduce.py). Before, the registry URI had two regexes
that disagreed on what an alias may hold.
"""

from __future__ import annotations

import re
from typing import Literal

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
