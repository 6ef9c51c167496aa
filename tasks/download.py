"""Stage 1, download: hub dataset or local file -> `data/raw/{train,test}.parquet`.

Hub datasets go through the real `datasets.load_dataset` (users with network); local
json/jsonl/csv/parquet files are read directly. When only a train split exists, a seeded
`split_ratio` of it is kept for training (seed 004's meaning) and the rest is the test split. A pandera contract checks that the columns the prompt and
completion templates name are present and never null, so a bad source fails here, not three
stages later.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from finetune.errors import PipelineError, TransientError
from finetune.files import atomic_dir
from finetune.workspace import Workspace
from tasks.contracts import validate_raw_split
from tasks.templates import template_columns

READERS = {
    ".jsonl": lambda p: pd.read_json(p, lines=True),
    ".json": lambda p: _read_json(p),
    ".csv": pd.read_csv,
    ".parquet": pd.read_parquet,
}


def download(ws: Workspace) -> dict[str, Path]:
    """Run the stage; returns the written split files."""
    data = ws.config.data
    if data.streaming:
        return _download_streamed(ws)
    splits = _load_splits(ws)
    splits = _ensure_test_split(splits, ws)
    if data.max_train_samples:
        splits[data.train_split] = splits[data.train_split].head(data.max_train_samples)
    if data.test_split and data.max_eval_samples:
        splits[data.test_split] = splits[data.test_split].head(data.max_eval_samples)

    required = template_columns(data)
    out: dict[str, Path] = {}
    with atomic_dir(ws.layout.raw) as staging:
        for role, name in (("train", data.train_split), ("test", data.test_split)):
            if name is None:
                continue
            frame = splits[name].reset_index(drop=True)
            validate_raw_split(frame, required, f"{_source_label(ws)} split '{name}'")
            frame.to_parquet(staging / f"{role}.parquet", index=False)
            out[role] = ws.layout.raw / f"{role}.parquet"
    return out


def _download_streamed(ws: Workspace) -> dict[str, Path]:
    """Streaming: only the test split is written; the train split's first rows are checked
    against the same contract, and `stream.json` records what the trainer will read."""
    from tasks import stream
    from tasks.stream_manifest import write_manifest

    data = ws.config.data
    source = stream.open_source(data, ws.root)
    required = template_columns(data)
    validate_raw_split(stream.head(data, source), required,
                       f"{_source_label(ws)} split '{data.train_split}' (first streamed rows)")
    test = stream.materialise_test(data, source)
    out: dict[str, Path] = {}
    with atomic_dir(ws.layout.raw) as staging:
        if test is not None:
            validate_raw_split(test, required, f"{_source_label(ws)} split '{data.test_split}'")
            test.to_parquet(staging / "test.parquet", index=False)
            out["test"] = ws.layout.raw / "test.parquet"
        write_manifest(staging, stream.source_manifest(data, source, ws.root))
    return out


def _load_splits(ws: Workspace) -> dict[str, pd.DataFrame]:
    data = ws.config.data
    if data.dataset_name:
        return _load_hub(data.dataset_name, data.subset)
    files = data.data_files or {data.train_split: data.json_file_path}
    return {split: _read_local(ws.resolve(path)) for split, path in files.items()}


def _read_local(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise PipelineError(f"data file {path} not found; fix data.json_file_path/data_files")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise PipelineError(
            f"data file {path}: unsupported extension '{path.suffix}' "
            f"(use one of {', '.join(sorted(READERS))})"
        )
    try:
        frame = reader(path)
    except ValueError as exc:
        raise PipelineError(f"data file {path}: cannot parse ({str(exc).splitlines()[0]})")
    if frame.empty:
        raise PipelineError(f"data file {path} has no rows")
    return frame


def _read_json(path: Path) -> pd.DataFrame:
    """A .json file is either a JSON array (Alpaca style) or JSON lines."""
    with open(path, encoding="utf-8") as fh:
        first = fh.read(1024).lstrip()[:1]
    return pd.read_json(path, lines=first != "[")


def _load_hub(name: str, subset: str | None) -> dict[str, pd.DataFrame]:
    import datasets

    try:
        loaded = datasets.load_dataset(name, subset)
    except Exception as exc:  # the hub client raises many types; all mean "not reachable"
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        why = (
            "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set and it is not in the local cache"
            if offline
            else f"the Hugging Face Hub could not be reached ({type(exc).__name__})"
        )
        error = PipelineError if offline else TransientError
        raise error(
            f"data.dataset_name '{name}': cannot load: {why}; connect to the network and unset "
            "HF_HUB_OFFLINE, or set data.json_file_path to a local file"
        ) from exc
    return {split: ds.to_pandas() for split, ds in loaded.items()}


def _ensure_test_split(splits: dict[str, pd.DataFrame], ws: Workspace) -> dict[str, pd.DataFrame]:
    data = ws.config.data
    if data.train_split not in splits:
        raise PipelineError(
            f"data.train_split '{data.train_split}' not found (splits: {', '.join(splits)})"
        )
    if data.test_split is None or data.test_split in splits:
        return splits
    if len(splits) > 1:  # the source has its own held-out split(s): a typo must not be carved
        raise PipelineError(
            f"data.test_split '{data.test_split}' not found (splits: {', '.join(splits)}); name "
            "one of them, or null to carve data.split_ratio from the train split"
        )
    train = splits[data.train_split]
    kept = train.sample(frac=data.split_ratio, random_state=data.seed).sort_index()
    test = train.drop(kept.index)
    if test.empty or kept.empty:
        raise PipelineError(
            f"data.split_ratio {data.split_ratio} leaves an empty split for {len(train)} rows"
        )
    return {**splits, data.train_split: kept, data.test_split: test}


def _source_label(ws: Workspace) -> str:
    data = ws.config.data
    return data.dataset_name or data.json_file_path or "data_files"
