"""Streaming (`data.streaming: true`): the train split is never written to disk.

Each source (a hub dataset, a local folder or local files) is opened as a `datasets`
IterableDataset. The download stage materialises only the test split (or, when the source has
none, the first `data.max_eval_samples` streamed rows, which the train stream then skips) and
checks the train split's first rows against the raw contract. Each training rank then reads
the train stream, shuffled through a `data.shuffle_buffer` buffer seeded with `data.seed +
epoch`, and turns it into examples with its dataset type's own format and encoder
(`DatasetType.examples`), chunk by chunk, so a streamed example is token for token what the
format and tokenize stages would have produced, for every type. A mixture's sources are
streamed the same way each and mixed with datasets' `interleave_datasets` (weights as
probabilities, seeded) or one after the other (concatenate). Rows with nothing to learn are
left out on the fly (a stream cannot be counted ahead).
"""

from __future__ import annotations

import contextlib

import re
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd

from finetune import json_input
from finetune.config.data import DataConfig
from finetune.config.schema import FinetuneConfig
from finetune.datatypes import DataContext
from finetune.errors import PipelineError, hub_unreachable
from finetune.files import file_sha256

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
#: rows formatted and tokenized per call (the tokenizer is fast on batches, slow row by row)
CHUNK = 256
#: train rows the download stage checks against the raw contract
HEAD_ROWS = 100
#: a split, or rows of it by number: `train`, `train[:1000]`, `train[100:600]`
ROW_SLICE = re.compile(r"^([^\[\]+%]+?)(?:\[(\d*):(\d*)\])?$")


def open_source(data: DataConfig, root: Path) -> dict[str, Any]:
    """{split name: IterableDataset}; nothing is read yet."""
    import datasets

    local = local_dataset(data, root)
    if data.dataset_name and local is None:
        try:
            return dict(datasets.load_dataset(data.dataset_name, data.subset, streaming=True))
        except Exception as exc:  # the hub client raises many types; all mean "not reachable"
            raise hub_unreachable("data.dataset_name", data.dataset_name, exc,
                                  "point data.data_files at local files", verb="stream") from exc
    if local is not None and local.is_dir():
        return dict(datasets.load_dataset(str(local), streaming=True))
    out = {}
    for split, path in local_files(data, root).items():
        if not path.exists():
            raise PipelineError(f"data file {path} not found; fix data.json_file_path/data_files")
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise PipelineError(f"data file {path}: unsupported extension '{path.suffix}' for "
                                f"streaming (use one of {', '.join(sorted(BUILDERS))})")
        out[split] = datasets.load_dataset(builder, data_files={split: str(path)}, split=split,
                                           streaming=True)
    return out


def local_files(data: DataConfig, root: Path) -> dict[str, Path]:
    """{split: file} of a source read from local files (none for a hub dataset or a folder)."""
    local = local_dataset(data, root)
    if (local is not None and local.is_dir()) or (data.dataset_name and local is None):
        return {}
    train = split_name(data.train_split)
    files = ({train: str(local)} if local is not None
             else data.data_files or {train: data.json_file_path})
    return {split: root / ref for split, ref in files.items()}


def first_rows(stream, n: int, path: Path | None = None) -> list[dict]:
    """The first `n` rows of a split's stream. datasets' Arrow JSON reader fails on a broken
    line with an internal error and a 0-based row; a JSON file's failure is named by its file
    and line instead (finetune.json_input, the download stage's reader too)."""
    with json_lines_named(path):
        return list(islice(iter(stream), n))


def column_values(stream, column: str, path: Path | None = None) -> list | None:
    """Every row's `column` (None where a row lacks it), reading the whole split but keeping
    only the column; None when no row has it. A broken JSON line as in `first_rows`."""
    has, values = False, []
    with json_lines_named(path):
        for row in stream:
            has = has or column in row
            values.append(row.get(column))
    return values if has else None


@contextlib.contextmanager
def json_lines_named(path: Path | None):
    """Within: a failure of datasets' reader on a JSON file is raised as one line naming the
    file and its broken line (the reader's own error otherwise), its error log kept quiet."""
    import logging

    # datasets logs its reader's failure as an error line of its own before raising it
    reader_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = reader_log.level
    reader_log.setLevel(logging.CRITICAL)
    try:
        yield
    except Exception as exc:  # ArrowInvalid, DatasetGenerationError: whatever datasets raises
        if path is None or path.suffix.lower() not in json_input.SUFFIXES:
            raise
        found = json_input.first_bad_line(path)
        if found is None:
            raise  # not a broken line: the reader's own failure
        raise json_input.line_error(path, *found) from exc
    finally:
        reader_log.setLevel(level)


def local_dataset(data: DataConfig, root: Path) -> Path | None:
    """`data.dataset_name` when it names a local file or folder (QEfficient's examples name the
    dataset there; a path that exists is read locally, anything else is a hub id)."""
    if not data.dataset_name:
        return None
    path = Path(data.dataset_name)
    path = path if path.is_absolute() else root / path
    return path if path.exists() else None


def split_name(spec: str) -> str:
    """`train` of `train[:1000]`."""
    return spec.split("[", 1)[0]


def rows_of(source: dict[str, Any], spec: str, key: str):
    """The stream of a split, or of rows of it by number (`train[100:600]`): a stream can
    skip and take, not count to a percentage or join splits."""
    match = ROW_SLICE.match(spec)
    if match is None:
        raise PipelineError(f"{key} '{spec}': a stream is sliced by row numbers only "
                            "(train[:1000], train[100:600]); percentages and unions of splits "
                            "need data.streaming: false")
    name, start, stop = match.groups()
    if name not in source:
        raise PipelineError(f"{key} '{spec}' not found (splits: {', '.join(source)})")
    stream = source[name]
    if start:
        stream = stream.skip(int(start))
    if stop:
        stream = stream.take(max(int(stop) - int(start or 0), 0))
    return stream


def holdout_rows(data: DataConfig, source: dict[str, Any]) -> int:
    """Rows at the head of the train stream that form the test split (the source has none)."""
    rows_of(source, data.train_split, "data.train_split")  # it exists and slices
    if data.test_split is None or split_name(data.test_split) in source:
        return 0
    if not data.max_eval_samples:
        raise PipelineError(
            f"data.streaming: the source has no '{data.test_split}' split and a stream cannot "
            "be split by data.split_ratio; set data.max_eval_samples to hold out the first N "
            "streamed rows as the test split (or data.test_split: null)")
    return data.max_eval_samples


def materialise_test(data: DataConfig, source: dict[str, Any]) -> pd.DataFrame | None:
    """The download stage's test split when streaming (bounded by max_eval_samples)."""
    if data.test_split is None:
        return None
    holdout = holdout_rows(data, source)
    if holdout:
        rows = list(rows_of(source, data.train_split, "data.train_split").take(holdout))
    else:
        stream = rows_of(source, data.test_split, "data.test_split")
        rows = list(stream.take(data.max_eval_samples) if data.max_eval_samples else stream)
    if not rows:
        raise PipelineError(f"data.streaming: the '{data.test_split}' split has no rows")
    return pd.DataFrame(rows)


def eval_only_rows(data: DataConfig, source: dict[str, Any]) -> pd.DataFrame:
    """An eval-only source's rows (its train split, bounded by max_eval_samples)."""
    stream = rows_of(source, data.train_split, "data.train_split")
    rows = list(stream.take(data.max_eval_samples) if data.max_eval_samples else stream)
    if not rows:
        raise PipelineError(f"data.streaming: the '{data.train_split}' split has no rows")
    return pd.DataFrame(rows)


def train_rows(data: DataConfig, source: dict[str, Any]):
    """The train split as the trainer reads it: holdout skipped, capped, shuffled per epoch."""
    stream = rows_of(source, data.train_split, "data.train_split")
    holdout = holdout_rows(data, source)
    if holdout:
        stream = stream.skip(holdout)
    if data.max_train_samples:
        stream = stream.take(data.max_train_samples)
    if data.shuffle_buffer > 1:
        stream = stream.shuffle(seed=data.seed, buffer_size=data.shuffle_buffer)
    return stream


def head(data: DataConfig, source: dict[str, Any], n: int = HEAD_ROWS,
         root: Path | None = None) -> pd.DataFrame:
    """The first train rows (in stream order), for the download stage's contract check (with
    the project `root`, a broken line of a local JSON file is named)."""
    path = local_files(data, root).get(split_name(data.train_split)) if root else None
    rows = first_rows(train_rows(data.model_copy(update={"shuffle_buffer": 1}), source), n,
                      path)
    if not rows:
        raise PipelineError(f"data.streaming: the '{data.train_split}' split has no rows")
    return pd.DataFrame(rows)


def source_manifest(data: DataConfig, source: dict[str, Any], root: Path) -> dict[str, Any]:
    """What the download stage decided about a train stream, and the local files' hashes: the
    streamed split is no DVC output, so this manifest is what changes when it does."""
    files = {}
    local = local_dataset(data, root)
    if local is not None:
        for path in sorted(local.rglob("*")) if local.is_dir() else [local]:
            if path.is_file():
                files[str(path.relative_to(root) if path.is_relative_to(root) else path)] = (
                    file_sha256(path))
    elif not data.dataset_name:
        for split, ref in (data.data_files or {data.train_split: data.json_file_path}).items():
            files[split] = file_sha256(root / ref)
    return {"train_split": data.train_split, "dataset_name": data.dataset_name,
            "subset": data.subset, "sha256": files, "holdout_rows": holdout_rows(data, source),
            "max_train_samples": data.max_train_samples, "shuffle_buffer": data.shuffle_buffer,
            "seed": data.seed}


def open_train_stream(cfg: FinetuneConfig, root: Path) -> Callable[[int], Iterator[dict]]:
    """The trainer's example source: `epoch -> iterator of {input_ids, labels}`.

    Called by the torchrun worker (named in the job file), once per rank."""
    from engine.prepare import load_tokenizer

    def tokenizer():
        tok = load_tokenizer(cfg.model, root)
        tok.model_max_length = int(1e9)  # we truncate ourselves
        return tok

    data = cfg.data
    ctx = DataContext(root, tokenizer, labels=list(data.labels) if data.labels else None)
    streams, weights = [], []
    for name, part in data.parts():
        if data.eval_only(name):
            continue
        source = open_source(part, root)
        rows = train_rows(part, source)
        columns = rows.column_names or list(head(part, source, 1).columns)  # hub: unknown
        streams.append(rows.map(_examples, batched=True, batch_size=CHUNK, with_indices=True,
                                remove_columns=columns,
                                fn_kwargs={"datatype": part.datatype, "ctx": ctx}))
        weights.append(next((s.weight for s in data.sources or () if s.name == name), 1.0))
    mixed = streams[0] if len(streams) == 1 else _mix(streams, weights, data)

    def examples(epoch: int) -> Iterator[dict]:
        mixed.set_epoch(epoch)  # datasets reshuffles (buffers and the interleaving) per epoch
        return iter(mixed)

    return examples


def _examples(batch: dict[str, list], indices: list[int], datatype, ctx: DataContext
              ) -> dict[str, list]:
    """One chunk of raw rows -> its training examples (the type's format and encoder)."""
    found = datatype.examples(pd.DataFrame(batch), "train", ctx, first_row=indices[0])
    # every column the type's examples carry (a prompt row's reward_inputs too)
    columns = list(found[0]) if found else ["input_ids", "labels"]
    return {c: [e[c] for e in found] for c in columns}


def _mix(streams: list, weights: list[float], data: DataConfig):
    import datasets

    if data.mixing == "concatenate":
        return datasets.concatenate_datasets(streams)
    total = sum(weights)
    return datasets.interleave_datasets(streams, probabilities=[w / total for w in weights],
                                        seed=data.seed, stopping_strategy=data.stopping_strategy)
