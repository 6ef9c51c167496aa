"""Parquet in and out a batch at a time, so a data stage's memory does not grow with the split.

`frames` reads a file's record batches as small pandas frames; `RowGroupWriter` collects
frames into row groups of a fixed row count and writes them with one `ParquetWriter`. A split
smaller than one row group is one group written from one frame, the bytes pandas'
`to_parquet` writes, so small splits (the default run's) keep their DVC hashes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

import pandas as pd

#: raw rows read and formatted at a time
BATCH_ROWS = 10_000
#: rows of one written row group: fixed, so the bytes never depend on how rows were batched
ROW_GROUP_ROWS = 10_000


def frames(path: Path, batch_rows: int = BATCH_ROWS) -> Iterator[pd.DataFrame]:
    """The file's rows as frames of at most `batch_rows` rows, each indexed from 0."""
    for batch in record_batches(path, batch_rows):
        yield batch.to_pandas()


def record_batches(path: Path, batch_rows: int):
    """The file's record batches of at most `batch_rows` rows, one row group at a time.
    Asked for all row groups at once, pyarrow reads every group's column chunks ahead
    (measured: 225 MB of Arrow memory for 1M Alpaca rows). A batch never spans two row
    groups: nothing downstream depends on where batches end."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as file:
        for group in range(file.num_row_groups):
            yield from file.iter_batches(batch_size=batch_rows, row_groups=[group])


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

    def _conformed(self, frame: pd.DataFrame):
        """A later group as the first group's schema: pandas infers each chunk's dtypes on
        its own (a column of whole numbers with a gap is float in one chunk, int in another),
        so the values are cast; a column whose values change kind is one line."""
        import pyarrow as pa

        from finetune.errors import PipelineError

        schema = self._writer.schema
        try:
            return pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):
            table = pa.Table.from_pandas(frame, preserve_index=False)
        try:
            return table.select(schema.names).cast(schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError, ValueError):
            raise PipelineError(
                f"{self.path.name}, rows from {self.rows}: {_first_mismatch(schema, table)}; "
                "give each column one type in the data file") from None

    def _flush(self, frame: pd.DataFrame) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:
            table = pa.Table.from_pandas(frame, preserve_index=False)
            self._writer = pq.ParquetWriter(self.path, table.schema)
        else:
            table = self._conformed(frame)
        self._writer.write_table(table, row_group_size=self.group_rows)
        self.rows += len(frame)


class Rows:
    """A split's rows without holding them: how many, and a way to read them again as frames
    (each indexed from 0, in order). Slicing, heads, masks and chains read only what they
    keep."""

    def __init__(self, count: int, read: Callable[[], Iterable[pd.DataFrame]]):
        self.count, self._read = count, read

    def frames(self) -> Iterator[pd.DataFrame]:
        return iter(self._read())

    def slice(self, start: int, stop: int) -> "Rows":
        """Rows [start, stop)."""
        start, stop = max(0, start), min(self.count, stop)

        def read():
            at = 0
            for frame in self.frames():
                lo, hi = max(start - at, 0), min(stop - at, len(frame))
                if lo < hi:
                    yield frame.iloc[lo:hi].reset_index(drop=True)
                at += len(frame)
                if at >= stop:
                    return

        return Rows(max(0, stop - start), read)

    def head(self, n: int) -> "Rows":
        return self.slice(0, n)

    def where(self, mask) -> "Rows":
        """The rows whose entry in the boolean array `mask` (one per row) is true."""
        def read():
            at = 0
            for frame in self.frames():
                part = mask[at:at + len(frame)]
                at += len(frame)
                if part.any():
                    yield frame[part].reset_index(drop=True)

        return Rows(int(mask.sum()), read)

    @staticmethod
    def chain(parts: list["Rows"]) -> "Rows":
        """Several splits' rows one after the other (`train[:50%]+test[:10]`)."""
        def read():
            for part in parts:
                yield from part.frames()

        return Rows(sum(p.count for p in parts), read)


def _first_mismatch(schema, table) -> str:
    for field in schema:
        if field.name in table.schema.names and table.schema.field(field.name).type != field.type:
            return (f"column '{field.name}' is {field.type} in the first rows but "
                    f"{table.schema.field(field.name).type} later")
    return f"columns {', '.join(table.schema.names)} differ from {', '.join(schema.names)}"
