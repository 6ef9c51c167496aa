"""The base every config section shares."""

import typing

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for every section: unknown keys are rejected, assignments re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def section_model(annotation) -> type[BaseModel] | None:
    """The Section class behind a field annotation (`X` or an optional `X | None`)."""
    candidates = typing.get_args(annotation) or (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None
