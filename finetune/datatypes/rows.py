"""Raw row -> text: `{column}` templates, `module:function` callables, the text column.

Shared by the types that render text from a row's columns (completion, text, classification).
Errors name the key, the split and the row: a missing column or a failing function is one line.
"""

from __future__ import annotations

import string
from typing import Any, Callable

from finetune.errors import PipelineError
from finetune.imports import load_object

RowFn = Callable[[dict[str, Any]], str]
TEMPLATE_KEYS = ("prompt_template", "prompt_func", "completion_template", "completion_func")


def check_exclusive_templates(data) -> None:
    """A part (prompt, completion) is a template or a function, not both: a ValueError
    naming the keys."""
    for part in ("prompt", "completion"):
        if getattr(data, f"{part}_template") is not None and getattr(data, f"{part}_func"):
            raise ValueError(
                f"{part}_template and {part}_func are exclusive; set one of them to null")


def template_columns(data) -> list[str]:
    """The raw columns a source's prompt and completion read: the templates' placeholders,
    and `input_columns` when a function builds either."""
    cols: list[str] = []
    for key in ("prompt_template", "completion_template"):
        if getattr(data, key) is not None:
            cols += placeholders(getattr(data, key), key)
    if (data.prompt_func or data.completion_func) and data.input_columns:
        cols += data.input_columns
    return cols


def placeholders(template: str, key: str) -> list[str]:
    """The columns a `{column}` template names, in order."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise PipelineError(f"data.{key}: malformed template ({exc})") from None
    for name in names:
        if not name:
            raise PipelineError(f"data.{key}: empty '{{}}' placeholder; name a column")
    return list(dict.fromkeys(names))


def builder(data, part: str) -> RowFn:
    """The function that turns one row into the `part` ("prompt" or "completion") text."""
    template = getattr(data, f"{part}_template")
    func_ref = getattr(data, f"{part}_func")
    if func_ref:
        fn = load_callable(func_ref, f"data.{part}_func")
        columns = data.input_columns
        return fn if not columns else lambda row: fn({c: row[c] for c in columns})
    if template is None:
        return lambda row: ""

    def render_row(row: dict[str, Any]) -> str:
        return template.format_map(row)

    return render_row


def load_callable(ref: str, key: str) -> RowFn:
    fn = load_object(ref, key)
    if not callable(fn):
        raise PipelineError(f"{key}: '{ref}' is not a function")
    return fn


def render(frame, fns: dict[str, RowFn], split: str, first_row: int = 0) -> dict[str, list]:
    """Each part's text for each row ({part: [texts]}); `first_row` keeps error messages' row
    numbers absolute when a stream renders chunk by chunk."""
    out: dict[str, list] = {part: [] for part in fns}
    for i, row in enumerate(frame.to_dict("records"), start=first_row):
        for part, fn in fns.items():
            try:
                value = fn(row)
            except KeyError as exc:
                raise PipelineError(
                    f"data.{part}_template names column {exc} which split '{split}' lacks "
                    f"(row {i}; columns: {', '.join(map(str, frame.columns))})"
                ) from None
            except Exception as exc:
                raise PipelineError(
                    f"data.{part}_func failed on split '{split}' row {i}: "
                    f"{type(exc).__name__}: {exc}") from None
            if not isinstance(value, str):
                raise PipelineError(
                    f"data.{part}_func returned {type(value).__name__} on split '{split}' row "
                    f"{i}; it must return a string")
            out[part].append(value)
    return out


def detect_text_field(frame, text_field: str | None, split: str,
                      exclude: str | None = None) -> str:
    """`text_field` if given, else a column named text/content, else the only string column
    (auto-detected when omitted)."""
    import pandas as pd

    if text_field:
        if text_field not in frame.columns:
            raise PipelineError(f"data.text_field '{text_field}' is not a column of split "
                                f"'{split}' (columns: {', '.join(map(str, frame.columns))})")
        return text_field
    for name in ("text", "content"):
        if name in frame.columns:
            return name
    strings = [c for c in frame.columns
               if c != exclude and pd.api.types.is_string_dtype(frame[c])]
    if len(strings) == 1:
        return strings[0]
    raise PipelineError(
        f"no templates set and no text column found in split '{split}' "
        f"(string columns: {', '.join(map(str, strings)) or 'none'}); set data.text_field or "
        "the templates"
    )


def text_column(frame, column: str) -> list[str]:
    """A text column as strings; a missing value is an empty text (dropped as such)."""
    return ["" if v is None or v != v else str(v) for v in frame[column].tolist()]
