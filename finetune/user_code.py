"""The SHA-256 of each file of user code a params file names: the 'module:name' references
(grpo.tools, rloo.environment_factory, a model_init, a collate_fn, ...: the fields marked
code_ref, finetune.config.section.code_refs) and the reward functions given as
'module:function'.

Why: the params file holds only the reference, so editing a tool, an environment or a reward
function changes what a run trains on while its params, data and model stay the same. The
hashes go into the run's lineage (what `finetune reproduce` and the registry show) and into the
checkpoint fingerprint (engine.state.fingerprint: a resume under edited code is refused, as
under edited data, unless checkpoint.resume_ignore_changes names `user_code`).

What is hashed: the source file that defines the referenced object (inspect's reading of it),
or, for an object whose source inspect cannot find, the file of the module the reference
names. Not the modules that file imports: a reference into a package hashes the one file.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from finetune.config.reward_refs import reward_kind
from finetune.config.rollout import ROLLOUT_SECTIONS
from finetune.config.section import code_refs
from finetune.files import file_sha256
from finetune.imports import load_object, module_of


def references(cfg: Any) -> list[tuple[str, str]]:
    """(dotted key, 'module:name') of each user code reference in `cfg`, in key order."""
    refs = [(key, ref) for key, ref in code_refs(cfg) if isinstance(ref, str) and ref]
    name = getattr(cfg.training, "type", None)  # a rollout method's reward functions
    section = getattr(cfg, name, None) if name in ROLLOUT_SECTIONS else None
    if section is not None:
        refs += [(f"{name}.reward_funcs[{i}]", ref) for i, ref in enumerate(section.reward_funcs)
                 if reward_kind(ref) == "code"]
    return refs


def source_file(ref: str, key: str) -> Path:
    """The file that defines what `ref` names (see the module docstring); one line naming
    `key` if it does not import."""
    obj = load_object(ref, key)
    try:
        found = inspect.getsourcefile(obj if inspect.isclass(obj) or inspect.isroutine(obj)
                                      else type(obj))
    except TypeError:  # a built-in, or an instance of one
        found = None
    return Path(found or module_of(ref, key).__file__).resolve()


def code_hashes(cfg: Any) -> dict[str, str]:
    """dotted key -> SHA-256 of the file its reference is defined in (`references`)."""
    return {key: file_sha256(source_file(ref, key)) for key, ref in references(cfg)}
