"""pandera data contracts at the generic stage boundaries: raw splits and tokenized splits.

What a formatted row is belongs to its dataset type (finetune.datatypes); these two hold for
every type. Each raises a one-line `PipelineError` naming split, column and first bad row.
"""

from __future__ import annotations

import pandas as pd
import pandera.pandas as pa

from finetune.datatypes.contract import check_frame
from finetune.errors import PipelineError


def validate_raw_split(frame: pd.DataFrame, required: list[str], where: str,
                       nullable: tuple[str, ...] = ()) -> None:
    """Raw data: at least one row; every column the type reads exists, and has no nulls unless
    the type drops such rows itself (`nullable`: a classifier's unlabeled rows)."""
    if frame.empty:
        raise PipelineError(f"{where}: no rows")
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise PipelineError(
            f"{where}: column '{missing[0]}' named by the prompt/completion template is missing "
            f"(columns: {', '.join(map(str, frame.columns))})"
        )
    schema = pa.DataFrameSchema(
        {c: pa.Column(nullable=c in nullable) for c in required}, strict=False, name="raw"
    )
    check_frame(schema, frame, where)


def validate_tokenized(frame: pd.DataFrame, max_len: int, where: str,
                       trainable: bool = True, aligned: bool = True) -> None:
    """Tokenized data, as per-row counts: lengths bounded, labels aligned, and, where the
    dataset type's rows carry targets (`trainable`, finetune.datatypes.base.requires_trainable),
    >= 1 trainable token. A prompt-only row has none: its method makes the completion.
    `aligned`: labels have one entry per input token (not so for an encoder-decoder model,
    whose labels are the decoder's: then they are bounded by max_len on their own)."""
    trained = [pa.Check.ge(1, name=">= 1 trainable token")] if trainable else []
    bounded = pa.Check.in_range(1, max_len, name=f"1 <= n <= {max_len}")
    schema = pa.DataFrameSchema(
        {
            "n_tokens": pa.Column(int, [bounded]),
            "n_labels": pa.Column(int, [] if aligned else [bounded]),
            "n_trainable": pa.Column(int, trained),
        },
        checks=[
            pa.Check(lambda df: df["n_tokens"] == df["n_labels"], name="labels aligned with tokens")
        ] if aligned else [],
        name="tokenized",
    )
    check_frame(schema, frame, where)
