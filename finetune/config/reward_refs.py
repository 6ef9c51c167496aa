"""What an entry of a reward-function list names (`grpo.reward_funcs`): a built-in, user code,
or a trained reward model, and the name its metrics carry.

The config validates the entries and reports their metrics with these, and the engine's
rollout (engine.rollout.rewards) loads them with the same rules, without either naming the
method whose section holds the list.
"""

from __future__ import annotations

import re
from typing import Literal

from finetune.config.model_refs import REGISTERED_MODEL, model_ref_kind

#: reward functions shipped with the engine, named by string (engine.rollout.rewards)
BUILT_IN_REWARDS = ("correctness", "format", "length")


def reward_kind(ref: str) -> Literal["built_in", "registered", "directory", "code"]:
    """What a reward entry names: a built-in, a registered reward model (`models:/...`), a
    reward model directory (a path: it has a '/'), or a function ('module:function',
    'path/to/file.py:function')."""
    model = model_ref_kind(ref)
    if model is not None:
        return "registered" if model == "registered" else "directory"
    return "code" if ":" in ref else "built_in"


def reward_name(ref: str) -> str:
    """An entry's name in the metrics (rewards/<name>/mean, reward_<name>): a built-in's, a
    function's, a registered model's, a directory's last part (word characters only)."""
    kind = reward_kind(ref)
    if kind == "registered":
        match = REGISTERED_MODEL.fullmatch(ref)
        name = match["name"] if match else ref
    elif kind == "directory":
        name = ref.rstrip("/").rsplit("/", 1)[-1]
    else:
        name = ref.rsplit(":", 1)[-1]
    return re.sub(r"\W", "_", name) or "reward_model"
