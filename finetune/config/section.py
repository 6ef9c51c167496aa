"""The base every config section shares, and the facts a field carries for the rest of the
code (`Field(..., fingerprint=True, code_ref=True)`).

A fact is about one key and is declared where the key is, so a new section (a new training
method's) declares its keys' facts beside their types and meanings: whether the key is in a
checkpoint's fingerprint (finetune/config/fingerprint.py derives the classification), whether
its value is user code the train stage loads before launch (engine/preflight.py walks
`code_refs`), and whether it names trained models the stages resolve and check
(`model_ref`: finetune/config/model_refs.py walks `model_ref_keys`, tasks/model_refs.py
resolves).
"""

import functools
import typing
from typing import Any, Callable, Iterator

import pydantic
from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.fields import FieldInfo

from finetune.config import reads

#: the facts `Field` takes (stored in the field's json_schema_extra under these names)
FACTS = ("fingerprint", "code_ref", "model_ref")


def Field(*args: Any, fingerprint: bool | None = None, code_ref: bool | tuple[str, ...] = False,
          model_ref: str | None = None, **kwargs: Any) -> Any:
    """pydantic's Field plus the key's facts:
    - `fingerprint`: True, the key decides a run's trajectory (it is in the config part of a
      checkpoint's fingerprint, so a resume with another value is refused); False, it does not.
      On a sub-section's field, False leaves the whole sub-section out (its own fields may say
      True). tests/test_key_lists.py requires a decision for every key, and True on the key's
      own field for every key that counts.
    - `code_ref`: the value is a 'module:function' reference to user code that must import
      and be callable; the train stage and `finetune validate` load it before launch
      (engine/preflight.py), naming the key in the refusal. A tuple: the key also takes
      these names of the pipeline's own functions, which are not user code.
    - `model_ref`: the value, or each element of a list value, that names a trained model (a
      registered `models:/NAME@alias` or `models:/NAME/VERSION`, or a folder:
      finetune.config.model_refs) names one for this role ("reward_model": what the folder
      must hold, and the words of the messages); the train and evaluate stages resolve a
      registered one to its downloaded folder and `finetune validate` checks each
      (tasks/model_refs.py). An element that names something else (a built-in's name, a
      function) is not a model reference and is left alone."""
    facts = {"fingerprint": fingerprint} if fingerprint is not None else {}
    if code_ref:
        facts["code_ref"] = list(code_ref) if isinstance(code_ref, tuple) else True
    if model_ref:
        facts["model_ref"] = model_ref
    if facts:
        kwargs["json_schema_extra"] = {**(kwargs.get("json_schema_extra") or {}), **facts}
    return pydantic.Field(*args, **kwargs)


def fact(field: FieldInfo, name: str) -> Any:
    """The fact `name` (one of FACTS) a field declares, or None."""
    extra = field.json_schema_extra
    return extra.get(name) if isinstance(extra, dict) else None


class Section(BaseModel):
    """Base for every section: unknown keys are rejected, assignments re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if reads.recording() and not isinstance(value, Section) and name in type(
                self).model_fields:
            reads.note(type(self), name)  # which keys a stage reads (dvc.yaml completeness)
        return value

    @model_validator(mode="before")
    @classmethod
    def _yaml_no_is_a_word(cls, data):
        """YAML 1.1 reads a bare `no` as false; for choices like save_strategy it is the word."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if data.get(name) is False and "no" in typing.get_args(field.annotation):
                    data = {**data, name: "no"}
        return data


def section_model(annotation) -> type[BaseModel] | None:
    """The Section class behind a field annotation (`X` or an optional `X | None`)."""
    candidates = typing.get_args(annotation) or (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def flatten(data: dict[str, Any], prefix: str = "",
            descend: Callable[[dict], bool] = lambda mapping: True) -> dict[str, Any]:
    """A dumped config as dotted keys (`training.max_steps`); a non-empty mapping is walked
    into when `descend(mapping)`, else kept as one value (as an empty one always is)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and descend(value):
            flat.update(flatten(value, f"{name}.", descend))
        else:
            flat[name] = value
    return flat


def did_you_mean(value: str, choices) -> str:
    """' (did you mean 'x'?)' for the choice `value` is in another case (adamw -> AdamW), else
    the closest by spelling, else ''."""
    import difflib

    choices = list(choices)
    same = [c for c in choices if isinstance(c, str) and c.lower() == str(value).lower()]
    close = same or difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def fields_of(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo, bool]]:
    """(dotted key, field, is a sub-section) of every field of `model`, sub-sections' fields
    after the sub-section's own entry, in declaration order."""
    for name, field in model.model_fields.items():
        sub = section_model(field.annotation)
        yield f"{prefix}{name}", field, sub is not None
        if sub is not None:
            yield from fields_of(sub, f"{prefix}{name}.")


@functools.cache
def code_ref_keys(model: type[BaseModel]) -> tuple[str, ...]:
    """The dotted keys whose field says code_ref=True."""
    return tuple(key for key, field, _ in fields_of(model) if fact(field, "code_ref"))


def code_refs(config: BaseModel) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of each code_ref field of `config` (None inside an absent optional
    sub-section, and for a name of the pipeline's own the field takes; a list field's items as
    `key[i]`, a mapping's as `key.NAME`); only those keys are read, so a stage's recorded
    reads stay its own."""
    for key in code_ref_keys(type(config)):
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part) if value is not None else None
        builtin = fact(_field_at(type(config), key), "code_ref")
        if isinstance(value, list):  # a list of references (grpo.tools): each by its index
            for i, item in enumerate(value):
                yield f"{key}[{i}]", item
            continue
        if isinstance(value, dict):  # named references (grpo.environment_factory): by name
            for name, item in value.items():
                yield f"{key}.{name}", item
            continue
        yield key, None if isinstance(builtin, list) and value in builtin else value


@functools.cache
def model_ref_keys(model: type[BaseModel]) -> tuple[tuple[str, str], ...]:
    """(dotted key, role) of each field that says model_ref=ROLE."""
    return tuple((key, fact(field, "model_ref")) for key, field, _ in fields_of(model)
                 if fact(field, "model_ref"))


def _field_at(model: type[BaseModel], dotted: str) -> FieldInfo:
    for part in dotted.split(".")[:-1]:
        model = section_model(model.model_fields[part].annotation)
    return model.model_fields[dotted.rsplit(".", 1)[-1]]


def dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config class (sections walked into): the schema's key list, for
    the loader's hints and the overrides' (which cannot import the loader)."""
    keys = []
    for name, field in model.model_fields.items():
        sub = section_model(field.annotation)
        keys += dotted_keys(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]
    return keys
