"""Prompt/completion builders: `{column}` templates or `module:function` callables."""

from __future__ import annotations

import string
from typing import Any, Callable

from finetune.config.data import DataConfig
from finetune.errors import PipelineError
from finetune.imports import load_object

RowFn = Callable[[dict[str, Any]], str]


def template_columns(data: DataConfig) -> list[str]:
    """Columns the templates (or the text field, or the messages field) read; the raw contract
    requires them."""
    if data.dataset_type == "chat":
        return [data.messages_field] if data.messages_field else []  # else found at format
    if data.dataset_type == "text":
        return [data.text_field] if data.text_field else []
    cols: list[str] = []
    keys = ("prompt_template", "completion_template")
    if data.dataset_type == "classification":
        cols = [data.label_column] + ([data.text_field] if data.text_field else [])
        keys = ("prompt_template",) if data.input_template_key == "prompt_template" else ()
    for key in keys:
        template = getattr(data, key)
        if template is None:
            continue
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
        except ValueError as exc:
            raise PipelineError(f"data.{key}: malformed template ({exc})") from None
        for name in names:
            if not name:
                raise PipelineError(f"data.{key}: empty '{{}}' placeholder; name a column")
            if name not in cols:
                cols.append(name)
    if data.text_mode and data.text_field:
        cols.append(data.text_field)
    if (data.prompt_func or data.completion_func) and data.input_columns:
        cols += [c for c in data.input_columns if c not in cols]
    return cols


def builder(data: DataConfig, part: str) -> RowFn:
    """The function that turns one row into the prompt or the completion."""
    template = getattr(data, f"{part}_template")
    func_ref = getattr(data, f"{part}_func")
    if func_ref:
        fn = load_callable(func_ref, f"data.{part}_func")
        columns = data.input_columns
        return fn if not columns else lambda row: fn({c: row[c] for c in columns})
    if template is None:
        return lambda row: ""

    def render(row: dict[str, Any]) -> str:
        return template.format_map(row)

    return render


def load_callable(ref: str, key: str) -> RowFn:
    fn = load_object(ref, key)
    if not callable(fn):
        raise PipelineError(f"{key}: '{ref}' is not a function")
    return fn
