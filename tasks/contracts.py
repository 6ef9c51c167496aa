"""pandera data contracts, one per stage boundary.

Each returns nothing on success and raises a one-line `PipelineError` that names the split,
the column and the first offending row, because a pandera report table is not what a user at a
terminal (or a Prefect log) needs.
"""

from __future__ import annotations

import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaError, SchemaErrors

from finetune.errors import PipelineError


def _check(schema: pa.DataFrameSchema, frame: pd.DataFrame, where: str) -> None:
    try:
        schema.validate(frame, lazy=True)
    except SchemaErrors as exc:
        cases = exc.failure_cases
        first = cases.iloc[0]
        column = first.get("column") or first.get("schema_context")
        index = first.get("index")
        row = "" if pd.isna(index) else f" row {int(index)}"
        raise PipelineError(
            f"{where}: column '{column}'{row} fails {first['check']} "
            f"({len(cases)} failing value(s); first: {first['failure_case']!r})"
        ) from None
    except SchemaError as exc:  # pragma: no cover - lazy=True raises SchemaErrors
        raise PipelineError(f"{where}: {exc}") from None


def validate_raw_split(frame: pd.DataFrame, required: list[str], where: str) -> None:
    """Raw data: at least one row; every column a template names exists and has no nulls."""
    if frame.empty:
        raise PipelineError(f"{where}: no rows")
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise PipelineError(
            f"{where}: column '{missing[0]}' named by the prompt/completion template is missing "
            f"(columns: {', '.join(map(str, frame.columns))})"
        )
    schema = pa.DataFrameSchema(
        {c: pa.Column(nullable=False) for c in required}, strict=False, name="raw"
    )
    _check(schema, frame, where)


def validate_formatted(frame: pd.DataFrame, where: str, allow_empty_prompt: bool) -> None:
    """Formatted data: prompt and completion are strings; completion never empty."""
    non_empty = pa.Check(lambda s: s.str.len() > 0, element_wise=False, name="non-empty string")
    schema = pa.DataFrameSchema(
        {
            "prompt": pa.Column(str, [] if allow_empty_prompt else [non_empty], nullable=False),
            "completion": pa.Column(str, [non_empty], nullable=False),
        },
        strict=False,
        name="formatted",
    )
    _check(schema, frame, where)


def validate_tokenized(frame: pd.DataFrame, max_len: int, where: str) -> None:
    """Tokenized data, as per-row counts: lengths bounded, labels aligned, >= 1 trainable token."""
    schema = pa.DataFrameSchema(
        {
            "n_tokens": pa.Column(int, [pa.Check.in_range(1, max_len, name=f"1 <= n <= {max_len}")]),
            "n_labels": pa.Column(int),
            "n_trainable": pa.Column(int, [pa.Check.ge(1, name=">= 1 trainable token")]),
        },
        checks=[
            pa.Check(lambda df: df["n_tokens"] == df["n_labels"], name="labels aligned with tokens")
        ],
        name="tokenized",
    )
    _check(schema, frame, where)
