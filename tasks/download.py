"""Stage 1, download: hub dataset or local file -> `data/raw/{train,test}.parquet`.

Hub datasets go through the real `datasets.load_dataset` (users with network); local
json/jsonl/csv/parquet files are read directly, and so is `dataset_name` when it names a local
file or folder (as QEfficient's examples name the dataset). When only a train split exists, a
seeded `split_ratio` of it is kept for training (QEfficient's meaning) and the rest is the test
split. A pandera contract checks that the columns the dataset type reads are present and never
null, so a bad source fails here, not three stages later.
"""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from finetune import json_input
from finetune.config.data import DataConfig
from finetune.errors import PipelineError, hub_unreachable
from finetune.files import atomic_dir
from finetune.parquet_batches import BATCH_ROWS, RowGroupWriter, Rows, frames, row_count
from finetune.workspace import Workspace
from tasks.contracts import validate_raw_split

#: local file suffixes the stage reads (a JSON array is read whole: it has no lines to stream)
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def download(ws: Workspace) -> dict[str, Path]:
    """Run the stage; returns the written split files (`<source>/<split>` for a mixture, whose
    sources each get a folder)."""
    if ws.config.data.streaming:
        return _download_streamed(ws)
    out: dict[str, Path] = {}
    with atomic_dir(ws.layout.raw) as staging:
        for name, data in ws.config.data.parts():
            folder = staging / name if name else staging
            folder.mkdir(exist_ok=True)
            download_one = _download_eval_only if ws.config.data.eval_only(name) else (
                _download_source)
            for role, file in download_one(ws, data, name, folder).items():
                key = f"{name}/{role}" if name else role
                out[key] = ws.layout.raw / file.relative_to(staging)
    return out


def _download_source(ws: Workspace, data: DataConfig, name: str | None,
                     folder: Path) -> dict[str, Path]:
    """One source's train and test splits, checked against its contract, into `folder`."""
    train, test = _train_and_test(_load_splits(ws, data), data)
    if data.max_train_samples:
        train = train.head(data.max_train_samples)
    if test is not None and data.max_eval_samples:
        test = test.head(data.max_eval_samples)
    label = f"source '{name}' ({_source_label(data)})" if name else _source_label(data)
    written = {}
    for role, split, rows in (("train", data.train_split, train),
                              ("test", data.test_split, test)):
        if rows is None:
            continue
        _write_checked(rows, data, f"{label} split '{split}'", folder / f"{role}.parquet")
        written[role] = folder / f"{role}.parquet"
    return written


def _download_eval_only(ws: Workspace, data: DataConfig, name: str,
                        folder: Path) -> dict[str, Path]:
    """An eval-only source: the rows its train split names become its test split."""
    splits = _load_splits(ws, data)
    check_split_names(data, list(splits), eval_only=True)
    test = pick(splits, data.train_split, "data.train_split")
    if data.max_eval_samples:
        test = test.head(data.max_eval_samples)
    _write_checked(test, data, f"source '{name}' ({_source_label(data)}, eval only)",
                   folder / "test.parquet")
    return {"test": folder / "test.parquet"}


def _write_checked(rows: Rows, data: DataConfig, where: str, path: Path) -> None:
    """A split's rows, frame by frame, checked against the raw contract (row numbers the
    split's own) and written to `path`."""
    if rows.count == 0:
        raise PipelineError(f"{where}: no rows")
    offset = 0
    with RowGroupWriter(path) as writer:
        for frame in rows.frames():
            frame.index = pd.RangeIndex(offset, offset + len(frame))
            _check_raw(frame, data, where)
            writer.write(frame.reset_index(drop=True))
            offset += len(frame)


def _check_raw(frame: pd.DataFrame, data: DataConfig, where: str) -> None:
    """The raw contract of the source's dataset type."""
    datatype = data.datatype
    validate_raw_split(frame, datatype.required_columns(), where, datatype.nullable_columns())


def _download_streamed(ws: Workspace) -> dict[str, Path]:
    """Streaming: only the test splits are written (an eval-only source's rows whole); each
    train stream's first rows are checked against the same contract, and `stream.json`
    records what the trainer will read."""
    from tasks import stream
    from tasks.stream_manifest import write_manifest

    top = ws.config.data
    out: dict[str, Path] = {}
    manifests: dict[str, dict] = {}
    with atomic_dir(ws.layout.raw) as staging:
        for name, data in top.parts():
            folder = staging / name if name else staging
            folder.mkdir(exist_ok=True)
            label = f"source '{name}' ({_source_label(data)})" if name else _source_label(data)
            source = stream.open_source(data, ws.root)
            if top.eval_only(name):
                test = stream.eval_only_rows(data, source)
            else:
                _check_raw(stream.head(data, source, root=ws.root), data,
                           f"{label} split '{data.train_split}' (first streamed rows)")
                test = stream.materialise_test(data, source)
                manifests[name] = stream.source_manifest(data, source, ws.root)
            if test is not None:
                _check_raw(test, data, f"{label} split '{data.test_split}'")
                test.to_parquet(folder / "test.parquet", index=False)
                out[f"{name}/test" if name else "test"] = ws.layout.raw / (
                    folder / "test.parquet").relative_to(staging)
        write_manifest(staging, manifests[None] if None in manifests else {
            "sources": manifests, "weights": {s.name: s.weight for s in top.sources},
            "mixing": top.mixing, "stopping_strategy": top.stopping_strategy, "seed": top.seed})
    return out


def _load_splits(ws: Workspace, data: DataConfig) -> dict[str, Rows]:
    from tasks.stream import local_dataset

    local = local_dataset(data, ws.root)
    if local is not None and local.is_dir():
        return _load_hub(str(local), data.subset)  # datasets reads a local folder's splits
    if local is not None:
        return {data.train_split: _read_local(local)}
    if data.dataset_name:
        return _load_hub(data.dataset_name, data.subset)
    files = data.data_files or {data.train_split: data.json_file_path}
    return {split: _read_local(ws.resolve(path)) for split, path in files.items()}


def _read_local(path: Path) -> Rows:
    """A local file's rows, read a frame at a time (parquet by record batch, JSON lines and
    CSV by pandas' chunked readers, so dtypes are pandas' own as before); counted here, which
    also finds a broken line before anything is written."""
    if not path.exists():
        raise PipelineError(f"data file {path} not found; fix data.json_file_path/data_files")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise PipelineError(
            f"data file {path}: unsupported extension '{path.suffix}' "
            f"(use one of {', '.join(sorted(SUFFIXES))})"
        )
    if suffix == ".parquet":
        rows = Rows(row_count(path), lambda: frames(path))
    else:
        read = lambda: _chunks(path)  # noqa: E731
        rows = Rows(sum(len(f) for f in read()), read)
    if rows.count == 0:
        raise PipelineError(f"data file {path} has no rows")
    return rows


def _chunks(path: Path) -> Iterator[pd.DataFrame]:
    """A JSON or CSV file's frames, each indexed from 0; a parse error is one line naming
    the file (and, for JSON, the broken line)."""
    json_file = path.suffix.lower() in json_input.SUFFIXES
    try:
        if json_file and json_input.is_array(path):  # one JSON value: parsed whole
            reader = [json_input.read_frame(path)]
        elif json_file:
            reader = pd.read_json(path, lines=True, chunksize=BATCH_ROWS)
        else:
            reader = pd.read_csv(path, chunksize=BATCH_ROWS)
        with contextlib.nullcontext(reader) if isinstance(reader, list) else reader:
            for frame in reader:
                yield frame.reset_index(drop=True)
    except pd.errors.EmptyDataError:
        return
    except ValueError as exc:
        if json_file:
            raise json_input.parse_error(path, exc) from None
        raise PipelineError(f"data file {path}: cannot parse ({str(exc).splitlines()[0]})")


def _load_hub(name: str, subset: str | None) -> dict[str, Rows]:
    import datasets

    try:
        loaded = datasets.load_dataset(name, subset)
    except Exception as exc:  # the hub client raises many types; all mean "not reachable"
        raise hub_unreachable("data.dataset_name", name, exc,
                              "set data.json_file_path to a local file") from exc
    return {split: Rows(len(ds), partial(_dataset_frames, ds)) for split, ds in loaded.items()}


def _dataset_frames(ds) -> Iterator[pd.DataFrame]:
    """A datasets split's rows (memory-mapped Arrow), a record batch at a time."""
    for table in ds.with_format("arrow").iter(BATCH_ROWS):
        yield table.to_pandas()


def _train_and_test(splits: dict[str, Rows], data: DataConfig) -> tuple[Rows, Rows | None]:
    """The train and test rows: the named splits (sliced as datasets slices, `train[:1000]`),
    or, when the source has only a train split, a seeded `split_ratio` of it and the rest."""
    check_split_names(data, list(splits))
    train = pick(splits, data.train_split, "data.train_split")
    if data.test_split is None:
        return train, None
    if split_name(data.test_split) in splits:
        return train, pick(splits, data.test_split, "data.test_split")
    kept = kept_rows(train.count, data.split_ratio, data.seed)
    if kept.all() or not kept.any():
        raise PipelineError(
            f"data.split_ratio {data.split_ratio} leaves an empty split for {train.count} rows"
        )
    return train.where(kept), train.where(~kept)


def kept_rows(count: int, ratio: float, seed: int) -> np.ndarray:
    """Which of `count` rows a seeded `ratio` keeps: the rows pandas' `sample(frac=ratio,
    random_state=seed)` draws (the same RandomState call), as a mask (1 byte a row)."""
    drawn = np.random.RandomState(seed).choice(count, size=round(ratio * count), replace=False)
    mask = np.zeros(count, dtype=bool)
    mask[drawn] = True
    return mask


def check_split_names(data: DataConfig, names: list[str], eval_only: bool = False) -> None:
    """The splits a source's params name are among the source's `names` (`finetune validate`
    asks this of the files' split names before any stage runs): the train split, and the test
    split unless it is carved from a lone train split by split_ratio."""
    if split_name(data.train_split) not in names:
        raise PipelineError(
            f"data.train_split '{data.train_split}' not found (splits: {', '.join(names)})")
    if eval_only or data.test_split is None or split_name(data.test_split) in names:
        return
    if len(names) > 1:  # the source has its own held-out split(s): a typo must not be carved
        raise PipelineError(
            f"data.test_split '{data.test_split}' not found (splits: {', '.join(names)}); name "
            "one of them, or null to carve data.split_ratio from the train split")


def split_name(spec: str) -> str:
    """`train` of `train[:1000]`."""
    return spec.split("[", 1)[0]


def pick(splits: dict[str, Rows], spec: str, key: str) -> Rows:
    """The rows `spec` names: a split, or a slice of it as datasets writes one (`train[:1000]`,
    `train[10%:20%]`, `train[:50%]+test[:10]`), resolved by datasets' own ReadInstruction."""
    if "[" not in spec and "+" not in spec:
        return splits[spec]
    import datasets

    try:
        parts = datasets.ReadInstruction.from_spec(spec).to_absolute(
            {name: rows.count for name, rows in splits.items()})
    except (ValueError, AssertionError) as exc:
        raise PipelineError(f"{key} '{spec}': not a split or slice datasets can read, e.g. "
                            f"train[:1000] or train[10%:] ({exc})") from None
    return Rows.chain([splits[p.splitname].slice(p.from_, p.to) for p in parts])


def _source_label(data: DataConfig) -> str:
    return data.dataset_name or data.json_file_path or "data_files"
