"""pandera contracts as one-line errors, and the checks the dataset types' row contracts share.

`check_frame` returns nothing on success and raises a one-line `PipelineError` that names the
split, the column and the first offending row, because a pandera report table is not what a
user at a terminal (or a Prefect log) needs. pandera is imported on first use: the config
imports this package, and `finetune validate` should not pay for it.
"""

from __future__ import annotations

from finetune.errors import PipelineError


def check_frame(schema, frame, where: str) -> None:
    """Validate `frame` against a pandera schema; the first failure is one line."""
    import pandas as pd
    from pandera.errors import SchemaError, SchemaErrors

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


def non_empty_text():
    """A string column whose values hold more than whitespace."""
    import pandera.pandas as pa

    return pa.Check(lambda s: s.str.strip().str.len() > 0, element_wise=False,
                    name="non-empty string")


def pair_schema(empty_prompt: bool, **extra):
    """The formatted rows of a prompt/completion type: both strings, the completion never
    empty (rows without one were dropped and counted), the prompt too unless `empty_prompt`;
    `extra`: further pandera columns."""
    import pandera.pandas as pa

    return pa.DataFrameSchema(
        {"prompt": pa.Column(str, [] if empty_prompt else [non_empty_text()], nullable=False),
         "completion": pa.Column(str, [non_empty_text()], nullable=False), **extra},
        strict=False, name="formatted")
