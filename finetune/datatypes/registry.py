"""Dataset type names -> types: the built-in eight, their aliases, a project's own.

The only place that knows which types exist. `data.dataset_type` names one of them, an alias
(QEfficient's `seq_completion`), a type registered by the project with `register_dataset_type`,
or a class by reference (`module:Class`, `path/to/file:Class`), like the other extension points.
The table is a finetune.registry.Registry; its refusals are ValueErrors (pydantic reports them
as the key's validation error).
"""

from __future__ import annotations

from finetune.datatypes.base import DatasetType
from finetune.datatypes.chat import ChatType
from finetune.datatypes.classification import ClassificationType
from finetune.datatypes.completion import CompletionType
from finetune.datatypes.preference import PreferenceType
from finetune.datatypes.prompt import PromptType
from finetune.datatypes.seq2seq import Seq2SeqType
from finetune.datatypes.text import TextType
from finetune.datatypes.unpaired_preference import UnpairedPreferenceType
from finetune.datatypes.vision import VisionChatType, VisionPreferenceType
from finetune.errors import PipelineError
from finetune.registry import Registry

DATASET_TYPES: Registry[type[DatasetType]] = Registry(
    "dataset type", "data.dataset_type", base=DatasetType, error=ValueError,
    unknown=("unknown dataset type '{name}' ({hint}types: {names}; aliases: {aliases}; or a "
             "project's own as 'module:Class')"),
    hint="did you mean '{}'? ",
    not_a_subclass="'{name}' is not a finetune.datatypes.DatasetType subclass")


def register_dataset_type(cls: type[DatasetType]) -> type[DatasetType]:
    """Make `cls` known by its name and aliases (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, DatasetType)) or not cls.name:
        raise TypeError(f"{cls!r} is not a DatasetType subclass with a name")
    return DATASET_TYPES.register(cls.name, cls, aliases=cls.aliases)


for _builtin in (CompletionType, TextType, ChatType, ClassificationType, PreferenceType,
                 PromptType, Seq2SeqType, UnpairedPreferenceType, VisionChatType,
                 VisionPreferenceType):
    register_dataset_type(_builtin)


def type_names() -> list[str]:
    """The registered types' names (aliases not included)."""
    return DATASET_TYPES.names()


def known_names() -> list[str]:
    return DATASET_TYPES.known()


def canonical(name: str) -> str:
    """The name a params file's value stands for: an alias's type name, a reference as written
    (after checking it loads a DatasetType); an unknown name is a ValueError with the closest
    known one."""
    if name in DATASET_TYPES or not DATASET_TYPES.is_reference(name):
        return DATASET_TYPES.canonical(name)
    type_class(name)
    return name


def type_class(name: str) -> type[DatasetType]:
    """The class a (canonical) name or `module:Class` reference stands for."""
    try:
        cls = DATASET_TYPES.get(name)
    except PipelineError as exc:  # a reference that does not import
        raise ValueError(str(exc).removeprefix("data.dataset_type: ")) from None
    if name not in DATASET_TYPES and cls.__abstractmethods__:
        raise ValueError(f"'{name}' does not implement "
                         f"{', '.join(sorted(cls.__abstractmethods__))} (DatasetType's "
                         "abstract methods)")
    return cls


def type_keys() -> set[str]:
    """Every data key some registered type owns."""
    return {k for name in DATASET_TYPES.names() for k in DATASET_TYPES.get(name).keys}
