"""Dataset type names -> types: the built-in five, their aliases, a project's own.

The only place that knows which types exist. `data.dataset_type` names one of them, an alias
(QEfficient's `seq_completion`), a type registered by the project with `register_dataset_type`,
or a class by reference (`module:Class`, `path/to/file:Class`), like the other extension points.
"""

from __future__ import annotations

import difflib

from finetune.datatypes.base import DatasetType
from finetune.datatypes.chat import ChatType
from finetune.datatypes.classification import ClassificationType
from finetune.datatypes.completion import CompletionType
from finetune.datatypes.preference import PreferenceType
from finetune.datatypes.text import TextType

_TYPES: dict[str, type[DatasetType]] = {}
_ALIASES: dict[str, str] = {}


def register_dataset_type(cls: type[DatasetType]) -> type[DatasetType]:
    """Make `cls` known by its name and aliases (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, DatasetType)) or not cls.name:
        raise TypeError(f"{cls!r} is not a DatasetType subclass with a name")
    _TYPES[cls.name] = cls
    for alias in cls.aliases:
        _ALIASES[alias] = cls.name
    return cls


for _builtin in (CompletionType, TextType, ChatType, ClassificationType, PreferenceType):
    register_dataset_type(_builtin)


def type_names() -> list[str]:
    """The registered types' names (aliases not included)."""
    return list(_TYPES)


def known_names() -> list[str]:
    return [*_TYPES, *_ALIASES]


def canonical(name: str) -> str:
    """The name a params file's value stands for: an alias's type name, a reference as written
    (after checking it loads a DatasetType); an unknown name is a ValueError with the closest
    known one."""
    if name in _TYPES:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    if ":" in name:
        type_class(name)
        return name
    close = difflib.get_close_matches(name, known_names(), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ValueError(f"unknown dataset type '{name}' ({hint}types: {', '.join(_TYPES)}; "
                     "aliases: " + ", ".join(f"{a} = {t}" for a, t in _ALIASES.items())
                     + "; or a project's own as 'module:Class')")


def type_class(name: str) -> type[DatasetType]:
    """The class a (canonical) name or `module:Class` reference stands for."""
    from finetune.errors import PipelineError
    from finetune.imports import load_object

    if name in _TYPES or name in _ALIASES:
        return _TYPES[_ALIASES.get(name, name)]
    try:
        cls = load_object(name, "data.dataset_type")
    except PipelineError as exc:
        raise ValueError(str(exc).removeprefix("data.dataset_type: ")) from None
    if not (isinstance(cls, type) and issubclass(cls, DatasetType)):
        raise ValueError(f"'{name}' is not a finetune.datatypes.DatasetType subclass")
    if cls.__abstractmethods__:
        raise ValueError(f"'{name}' does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))} (DatasetType's "
                         "abstract methods)")
    return cls


def type_keys() -> set[str]:
    """Every data key some registered type owns."""
    return {k for cls in _TYPES.values() for k in cls.keys}
