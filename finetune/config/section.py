"""The base every config section shares."""

import typing
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, model_validator

from finetune.config import reads


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
    """' (did you mean 'x'?)' for the closest of `choices` to a mistyped value, else ''."""
    import difflib

    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
