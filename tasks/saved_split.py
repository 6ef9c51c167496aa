"""A tokenized split saved as `datasets`' `save_to_disk` saves it, the same files byte for byte
(`data-0000i-of-0000N.arrow`, `state.json`, `dataset_info.json`), with resident memory that does
not grow with the split.

`save_to_disk` reads the split's memory-mapped Arrow file, and every page it reads stays
resident in the process until it exits: at 1M Alpaca rows that is a 3.3 GB peak (VmHWM) for a
3 GB file. Even opening the file as a Dataset maps in every record batch's header and list
offsets (about 150 KB a batch). Here the file is read with plain reads, one record batch at a
time, twice: once for its size (which decides the shard count, as in `save_to_disk`), once to
write the batches and shards `save_to_disk` cuts. A mixture (rows of several files, an index
mapping) is saved by `save_to_disk` itself (tasks.tokenize).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def save_split(arrow: Path, fingerprint: str, dest: Path, num_shards: int | None = None) -> None:
    """What `Dataset.from_file(arrow)` with `fingerprint` would write with
    `save_to_disk(dest, num_shards=num_shards)`. The tokenized columns hold no files to embed
    (Image, Audio), so the split's size is its batches' own."""
    import datasets
    from datasets import config
    from datasets.arrow_writer import ArrowWriter, get_writer_batch_size_from_data_size
    from datasets.table import InMemoryTable
    from datasets.utils.py_utils import convert_file_size_to_int

    schema, rows, nbytes = _size(arrow)
    # its features, info and state, as from_file gives them: built from the schema alone
    meta = datasets.Dataset(InMemoryTable(schema.empty_table()), fingerprint=fingerprint)
    if num_shards is None:  # save_to_disk's choices, from the same numbers
        shard_bytes = convert_file_size_to_int(config.MAX_SHARD_SIZE)
        num_shards = min(rows, int(nbytes / shard_bytes) + 1)
    batch_rows = config.DEFAULT_MAX_BATCH_SIZE
    if nbytes > 0:
        batch_rows = min(batch_rows, get_writer_batch_size_from_data_size(rows, nbytes))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    names = [f"data-{i:05d}-of-{num_shards:05d}.arrow" for i in range(num_shards)]
    with _Batches(arrow) as batches:
        for index, name in enumerate(names):
            writer = ArrowWriter(features=meta.features, path=str(dest / name),
                                 embed_local_files=True)
            try:
                for table in _tables(batches.take(_shard_rows(rows, num_shards, index)),
                                     batch_rows):
                    writer.write_table(table)
                writer.finalize()
            finally:
                writer.close()
    _write_metadata(meta, dest, names)


def _size(arrow: Path):
    """(schema, rows, bytes) of the Arrow stream file: the bytes as `Table.nbytes` counts
    them, batch by batch."""
    import pyarrow as pa

    rows = nbytes = 0
    with pa.OSFile(str(arrow)) as fh:
        reader = pa.ipc.open_stream(fh)
        for batch in reader:
            rows += batch.num_rows
            nbytes += batch.nbytes
        return reader.schema, rows, nbytes


class _Batches:
    """The file's record batches through plain reads, one at a time; `take(n)` hands out the
    next n rows, cutting a batch where they end."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "_Batches":
        import pyarrow as pa

        self._fh = pa.OSFile(str(self.path))
        self._reader = pa.ipc.open_stream(self._fh)
        self._rest = None  # the unread rows of a batch cut at a shard's end
        return self

    def __exit__(self, *_) -> None:
        self._fh.close()

    def take(self, rows: int) -> Iterator:
        while rows > 0:
            batch, self._rest = self._rest or self._reader.read_next_batch(), None
            if batch.num_rows > rows:
                batch, self._rest = batch.slice(0, rows), batch.slice(rows)
            rows -= batch.num_rows
            yield batch


def _shard_rows(total: int, num_shards: int, index: int) -> int:
    """Rows of contiguous shard `index` (Dataset.shard(contiguous=True)'s split)."""
    div, mod = divmod(total, num_shards)
    return div + (1 if index < mod else 0)


def _tables(batches: Iterator, size: int) -> Iterator:
    """Tables of `size` rows (the last one shorter) made of the batches' pieces, cut where
    datasets' `table_iter` cuts (each batch first split into `size`-row pieces): the pieces,
    not only the rows, decide a boolean column's padding bits in the written bytes."""
    import pyarrow as pa

    held, count = [], 0
    for batch in batches:
        for start in range(0, batch.num_rows, size):
            piece = batch.slice(start, size)
            if count + len(piece) < size:
                held.append(piece)
                count += len(piece)
                continue
            cut = size - count
            held.append(piece.slice(0, cut))
            yield pa.Table.from_batches(held)
            rest = piece.slice(cut)
            held, count = ([rest], len(rest)) if len(rest) else ([], 0)
    if held:
        yield pa.Table.from_batches(held)


def _write_metadata(ds, dest: Path, names: list[str]) -> None:
    """state.json and dataset_info.json as save_to_disk writes them."""
    from datasets import config
    from datasets.utils.py_utils import asdict

    state = {key: ds.__dict__[key] for key in ("_fingerprint", "_format_columns",
                                               "_format_kwargs", "_format_type",
                                               "_output_all_columns")}
    state["_split"] = str(ds.split) if ds.split is not None else None
    state["_data_files"] = [{"filename": name} for name in names]
    with open(dest / config.DATASET_STATE_JSON_FILENAME, "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=2, sort_keys=True)
    info = asdict(ds._info)
    with open(dest / config.DATASET_INFO_FILENAME, "w", encoding="utf-8") as fh:
        json.dump({key: info[key] for key in sorted(info)}, fh, indent=2)
