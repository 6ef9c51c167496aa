"""Streaming (`data.streaming: true`): the train split is never written to disk.

The source (a hub dataset or local files) is opened as a `datasets` IterableDataset. The
download stage materialises only the test split (or, when the source has none, the first
`data.max_eval_samples` streamed rows, which the train stream then skips) and checks the train
split's first rows against the raw contract. Each training rank then reads the train stream,
shuffled through a `data.shuffle_buffer` buffer seeded with `data.seed + epoch`, and formats and
tokenizes it on the fly with the format and tokenize stages' own row functions, so a streamed
example is token for token what the materialised pipeline would have produced.
"""

from __future__ import annotations

import os
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pandas as pd

from finetune.config.schema import DataConfig, FinetuneConfig
from finetune.errors import PipelineError, TransientError
from finetune.files import file_sha256

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
#: rows formatted and tokenized per call (the tokenizer is fast on batches, slow row by row)
CHUNK = 256
#: train rows the download stage checks against the raw contract
HEAD_ROWS = 100


def open_source(data: DataConfig, root: Path) -> dict[str, Any]:
    """{split name: IterableDataset}; nothing is read yet."""
    import datasets

    if data.dataset_name:
        try:
            return dict(datasets.load_dataset(data.dataset_name, data.subset, streaming=True))
        except Exception as exc:  # the hub client raises many types; all mean "not reachable"
            offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
            error = PipelineError if offline else TransientError
            raise error(f"data.dataset_name '{data.dataset_name}': cannot stream "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); connect to "
                        "the network, or point data.data_files at local files") from exc
    files = data.data_files or {data.train_split: data.json_file_path}
    out = {}
    for split, ref in files.items():
        path = root / ref
        if not path.exists():
            raise PipelineError(f"data file {path} not found; fix data.json_file_path/data_files")
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise PipelineError(f"data file {path}: unsupported extension '{path.suffix}' for "
                                f"streaming (use one of {', '.join(sorted(BUILDERS))})")
        out[split] = datasets.load_dataset(builder, data_files={split: str(path)}, split=split,
                                           streaming=True)
    return out


def holdout_rows(data: DataConfig, source: dict[str, Any]) -> int:
    """Rows at the head of the train stream that form the test split (the source has none)."""
    if data.train_split not in source:
        raise PipelineError(f"data.train_split '{data.train_split}' not found "
                            f"(splits: {', '.join(source)})")
    if data.test_split is None or data.test_split in source:
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
        rows = list(source[data.train_split].take(holdout))
    else:
        stream = source[data.test_split]
        rows = list(stream.take(data.max_eval_samples) if data.max_eval_samples else stream)
    if not rows:
        raise PipelineError(f"data.streaming: the '{data.test_split}' split has no rows")
    return pd.DataFrame(rows)


def train_rows(data: DataConfig, source: dict[str, Any]):
    """The train split as the trainer reads it: holdout skipped, capped, shuffled per epoch."""
    stream = source[data.train_split]
    holdout = holdout_rows(data, source)
    if holdout:
        stream = stream.skip(holdout)
    if data.max_train_samples:
        stream = stream.take(data.max_train_samples)
    if data.shuffle_buffer > 1:
        stream = stream.shuffle(seed=data.seed, buffer_size=data.shuffle_buffer)
    return stream


def head(data: DataConfig, source: dict[str, Any], n: int = HEAD_ROWS) -> pd.DataFrame:
    """The first train rows (in stream order), for the download stage's contract check."""
    rows = list(islice(iter(train_rows(data.model_copy(update={"shuffle_buffer": 1}), source)), n))
    if not rows:
        raise PipelineError(f"data.streaming: the '{data.train_split}' split has no rows")
    return pd.DataFrame(rows)


def source_manifest(data: DataConfig, source: dict[str, Any], root: Path) -> dict[str, Any]:
    """What the download stage decided about the train stream, and the local files' hashes:
    the streamed split is no DVC output, so this manifest is what changes when it does."""
    files = {}
    if not data.dataset_name:
        for split, ref in (data.data_files or {data.train_split: data.json_file_path}).items():
            files[split] = file_sha256(root / ref)
    return {"train_split": data.train_split, "dataset_name": data.dataset_name,
            "subset": data.subset, "sha256": files, "holdout_rows": holdout_rows(data, source),
            "max_train_samples": data.max_train_samples, "shuffle_buffer": data.shuffle_buffer,
            "seed": data.seed}


def open_train_stream(cfg: FinetuneConfig, root: Path) -> Callable[[int], Iterator[dict]]:
    """The trainer's example source: `epoch -> iterator of {input_ids, labels}`.

    Called by the torchrun worker (named in the job file), once per rank."""
    from engine.model import bos_prefix_id, load_tokenizer
    from tasks.format import detect_text_field, render
    from tasks.templates import builder
    from tasks.tokenize import encode_batch

    data = cfg.data
    rows = train_rows(data, open_source(data, root))
    tok = load_tokenizer(cfg.model, root)
    tok.model_max_length = int(1e9)  # we truncate ourselves
    bos = bos_prefix_id(tok)
    prompt_fn, completion_fn = builder(data, "prompt"), builder(data, "completion")

    def examples(epoch: int) -> Iterator[dict]:
        rows.set_epoch(epoch)  # datasets reshuffles with seed + epoch
        seen = 0
        for chunk in _chunks(rows, CHUNK):
            frame = pd.DataFrame(chunk)
            if data.text_mode:
                prompts = [""] * len(frame)
                completions = frame[detect_text_field(frame, data.text_field, "train")]
                completions = completions.astype(str).tolist()
            else:
                prompts, completions = render(frame, prompt_fn, completion_fn, "train", seen)
            seen += len(frame)
            enc = encode_batch({"prompt": prompts, "completion": completions}, tok, bos,
                               data.max_seq_length)
            for ids, labels, n in zip(enc["input_ids"], enc["labels"], enc["n_trainable"]):
                if n:  # no trainable token (prompt fills the window): dropped, as tokenize does
                    yield {"input_ids": ids, "labels": labels}

    return examples


def _chunks(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    it = iter(rows)
    while chunk := list(islice(it, size)):
        yield chunk
