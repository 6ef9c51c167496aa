"""Parquet in and out a batch at a time, so a data stage's memory does not grow with the split.

`frames` reads a file's record batches as small pandas frames; `RowGroupWriter` collects
frames into row groups of a fixed row count and writes them with one `ParquetWriter`. A split
smaller than one row group is one group written from one frame, the bytes pandas'
`to_parquet` writes, so small splits (the default run's) keep their DVC hashes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pandas as pd

#: raw rows read and formatted at a time
BATCH_ROWS = 10_000
#: rows of one written row group: fixed, so the bytes never depend on how rows were batched
ROW_GROUP_ROWS = 100_000


def frames(path: Path, batch_rows: int = BATCH_ROWS) -> Iterator[pd.DataFrame]:
    """The file's rows as frames of at most `batch_rows` rows, each indexed from 0."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as file:
        for batch in file.iter_batches(batch_size=batch_rows):
            yield batch.to_pandas()


def row_count(path: Path) -> int:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as file:
        return file.metadata.num_rows


class RowGroupWriter:
    """Frames in (any sizes), `ROW_GROUP_ROWS`-row groups out; the schema is the first
    group's (later groups are converted to it, so a batch whose column is all null still
    fits)."""

    def __init__(self, path: Path, group_rows: int = ROW_GROUP_ROWS):
        self.path, self.group_rows = Path(path), group_rows
        self.pending: list[pd.DataFrame] = []
        self.pending_rows = 0
        self.rows = 0
        self._writer = None

    def write(self, frame: pd.DataFrame) -> None:
        self.pending.append(frame)
        self.pending_rows += len(frame)
        while self.pending_rows >= self.group_rows:
            whole = pd.concat(self.pending, ignore_index=True)
            self._flush(whole.iloc[:self.group_rows].reset_index(drop=True))
            rest = whole.iloc[self.group_rows:].reset_index(drop=True)
            self.pending, self.pending_rows = [rest], len(rest)

    def close(self) -> None:
        """Write what is left (an empty split too: its columns, no rows)."""
        if self.pending_rows or self._writer is None:
            whole = (pd.concat(self.pending, ignore_index=True) if self.pending
                     else pd.DataFrame())
            self._flush(whole)
        self.pending, self.pending_rows = [], 0
        self._writer.close()

    def __enter__(self) -> "RowGroupWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        elif self._writer is not None:
            self._writer.close()

    def _flush(self, frame: pd.DataFrame) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:
            table = pa.Table.from_pandas(frame, preserve_index=False)
            self._writer = pq.ParquetWriter(self.path, table.schema)
        else:
            table = pa.Table.from_pandas(frame, schema=self._writer.schema,
                                         preserve_index=False)
        self._writer.write_table(table, row_group_size=self.group_rows)
        self.rows += len(frame)
