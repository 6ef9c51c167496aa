"""Stage 3, tokenize: formatted rows -> `data/tokenized/{train,test}` (Arrow) + token stats.

Tokenization happens here, once, never on the training ranks, with each source's dataset type's
encoder (finetune.datatypes): input_ids and labels, -100 where nothing is trained (the prompt,
the user turns), sequences truncated to `max_seq_length`. Rows left with no trainable token
(the prompt fills the window) are dropped and counted; above `data.max_dropped_fraction` the
stage fails instead of training on nothing, the silent failure TRL users report.
"""

from __future__ import annotations

import json
import shutil
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from engine.prepare import max_positions, read_labels, write_labels
from finetune.datatypes import DataContext
from finetune.datatypes.base import requires_trainable
from finetune.errors import PipelineError
from finetune.files import atomic_dir, write_json_atomic
from finetune.parquet_batches import record_batches, row_count
from finetune.workspace import Workspace
from tasks.contracts import validate_tokenized
from tasks.format import check_dropped, data_context
from tasks.mixture import mix
from tasks.saved_split import save_split
from tasks.stream_manifest import carry_manifest


def tokenize(ws: Workspace) -> dict[str, Path]:
    """Run the stage: each source's splits tokenized with its own type's encoder, a mixture's
    sources then mixed into one train and one test split (tasks.mixture)."""
    data = ws.config.data
    limit = max_positions(ws.config.model, ws.root)
    if limit and data.max_seq_length > limit:
        raise PipelineError(
            f"data.max_seq_length {data.max_seq_length} exceeds the model's "
            f"max_position_embeddings {limit}; set data.max_seq_length <= {limit}"
        )
    ctx = data_context(ws)
    if ctx.tokenizer.eos_token_id is None:
        raise PipelineError(f"model.name_or_path {ws.config.model.name_or_path}: tokenizer has no EOS token")
    ctx.labels = read_labels(ws.layout.formatted)  # a classifier's label map, else None
    stats: dict[str, Any] = {}
    out: dict[str, Path] = {}
    with atomic_dir(ws.layout.tokenized) as staging:
        splits: dict[str, list] = {}  # role -> [(source name, its Encoded split)]
        scratch = staging / ".encoded"  # the encoded splits before they are saved
        scratch.mkdir()
        for name, part in data.parts():
            formatted = ws.layout.formatted / name if name else ws.layout.formatted
            for file in sorted(formatted.glob("*.parquet")):
                role = f"{name}/{file.stem}" if name else file.stem  # how errors name it
                encoded, split_stats = _tokenize_file(file, part.datatype, ctx, role, ws,
                                                      scratch)
                splits.setdefault(file.stem, []).append((name, encoded))
                if name:
                    stats.setdefault("sources", {}).setdefault(name, {})[file.stem] = split_stats
                else:
                    stats[file.stem] = split_stats
        for role, parts in splits.items():
            if data.sources:  # rows of several files: datasets mixes and saves them
                ds = mix([(n, e.dataset()) for n, e in parts], data, role, stats["sources"])
                stats[role] = _totals(ds).stats(sum(
                    stats["sources"][n][role]["dropped_rows"] for n, _ in parts))
                ds.save_to_disk(str(staging / role))
            else:  # one file: streamed into the saved split, nothing of it memory-mapped
                save_split(parts[0][1].arrow, parts[0][1].fingerprint, staging / role)
            out[role] = ws.layout.tokenized / role
        shutil.rmtree(scratch)  # saved: the scratch files are not part of the output
        if ctx.labels is not None:
            write_labels(staging, ctx.labels)
        gguf = ws.config.model.gguf_file  # the tokenizer's file, named only when set
        carry_manifest(ws.layout.formatted, staging, max_seq_length=data.max_seq_length,
                       model=ws.config.model.name_or_path, revision=ws.config.model.revision,
                       **({"gguf_file": gguf} if gguf else {}))
    if not out and not data.streaming:  # streaming without a test split: nothing to tokenize
        raise PipelineError(f"{ws.layout.formatted}: no formatted splits; run format first")
    write_json_atomic(ws.layout.metrics / "tokenize.json", stats)
    return out


def _tokenize_file(file: Path, datatype, ctx: DataContext, role: str, ws: Workspace,
                   scratch: Path) -> tuple["Encoded", dict[str, Any]]:
    """One formatted split -> (encoded split, its stats), rows without a trainable token
    dropped (up to data.max_dropped_fraction) and the result checked. The split is encoded
    batch by batch into an Arrow file under `scratch` (tasks.saved_split copies it into the
    saved split with plain reads), so memory holds a few batches and running totals, whatever
    the row count."""
    data = ws.config.data
    fn, kwargs = datatype.encoder(ctx)
    tok = ctx.tokenizer
    model = ws.config.model  # a GGUF base's tokenizer is its file's
    model_ref = "/".join(filter(None, (model.name_or_path, model.gguf_file)))
    fingerprint = _fingerprint(file, tok, ctx.bos, data.max_seq_length, model_ref, kwargs,
                               datatype)
    trainable = requires_trainable(datatype.targets)  # a prompt-only row trains no token
    where = f"tokenize split '{role}'"

    def check(counts: pd.DataFrame) -> None:  # one batch's kept rows, indexed as in the split
        validate_tokenized(counts, data.max_seq_length, where, trainable,
                           aligned=datatype.labels_aligned)

    arrow = scratch / f"{role.replace('/', '--')}.arrow"
    totals, seen, first_dropped = _encode_file(file, arrow, fn, {"tok": tok, **kwargs},
                                               workers(data.num_proc), trainable, check)
    dropped = seen - totals.rows
    if trainable:
        check_dropped(dropped, seen, data.max_dropped_fraction, where,
                      f"no trainable token ({datatype.untrainable})", first_dropped,
                      "raise data.max_seq_length or shorten the prompts")
    # the fingerprint the map -> select -> add_column("length") chain gave it before
    return Encoded(arrow, f"{fingerprint}-length"), totals.stats(dropped)


@dataclass(frozen=True)
class Encoded:
    """A tokenized split before it is saved: its scratch Arrow file and its datasets
    fingerprint (what `state.json` records)."""

    arrow: Path
    fingerprint: str

    def dataset(self):
        """The split as a memory-mapped Dataset (a mixture's source)."""
        import datasets

        ds = datasets.Dataset.from_file(str(self.arrow))
        ds._fingerprint = self.fingerprint
        return ds


def workers(num_proc: int | None) -> int:
    """data.num_proc, or the cores this process may run on when it is null."""
    import os

    return num_proc or len(os.sched_getaffinity(0))


#: rows a tokenize batch holds (datasets.map's default batch size)
BATCH_ROWS = 1000


def _encode_file(file: Path, arrow: Path, fn, fn_kwargs: dict, num_proc: int,
                 trainable: bool, check: Callable[[pd.DataFrame], None]
                 ) -> tuple["Totals", int, int | None]:
    """Encode the parquet file's record batches (in `num_proc` worker processes, in order:
    the bytes are the same for any num_proc) into the Arrow file `arrow`, rows without a
    trainable token left out when `trainable`, each row's `length` (for group_by_length)
    added, the kept rows' counts handed to `check` CHECK_ROWS at a time. Returns the kept
    rows' totals, the rows read and the first dropped row."""
    from datasets.arrow_writer import ArrowWriter

    batches = record_batches(file, BATCH_ROWS)
    num_proc = min(num_proc, -(-row_count(file) // BATCH_ROWS))  # no idle workers
    totals, seen, first_dropped = Totals(), 0, None
    pending: list[pd.DataFrame] = []  # kept rows' counts not yet checked
    checked = 0
    with _encoded_batches(batches, fn, fn_kwargs, num_proc) as encoded, \
            ArrowWriter(path=str(arrow)) as writer:
        for table in encoded:
            counts = _counts_of(table)
            if trainable:
                keep = counts["n_trainable"].to_numpy() > 0
                if not keep.all():
                    if first_dropped is None:
                        first_dropped = seen + int(np.argmin(keep))
                    table, counts = table.filter(pa.array(keep)), counts[keep]
            seen += len(keep) if trainable else len(counts)
            totals.add(counts)
            pending.append(counts)
            if sum(map(len, pending)) >= CHECK_ROWS:
                checked = _check_pending(pending, checked, check)
            writer.write_table(table.append_column("length", pa.array(
                counts["n_tokens"].to_numpy())))  # an empty batch too: the schema
        if seen == 0:
            raise PipelineError(f"{file}: no rows; run the format stage again")
        _check_pending(pending, checked, check)
        writer.finalize()
    return totals, seen, first_dropped


#: kept rows' counts checked against the contract at a time (25 bytes a row): a pandera
#: call costs milliseconds whatever its size, too much for every 1000-row batch
CHECK_ROWS = 10_000


def _check_pending(pending: list[pd.DataFrame], checked: int,
                   check: Callable[[pd.DataFrame], None]) -> int:
    """Check the pending counts (indexed as the split's kept rows: the contract names the
    row), empty the list; returns the rows checked so far."""
    if not pending:
        return checked
    counts = pd.concat(pending, ignore_index=True)
    counts.index = pd.RangeIndex(checked, checked + len(counts))
    check(counts)
    pending.clear()
    return checked + len(counts)


@contextmanager
def _encoded_batches(batches, fn, fn_kwargs: dict, num_proc: int):
    """The encoded Arrow table of each record batch, in input order: mapped here, or by a
    pool of `num_proc` processes (forked, as datasets' map forks its workers)."""
    if num_proc <= 1:
        yield (_encode_batch(b, fn, fn_kwargs) for b in batches)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(
            num_proc, initializer=_init_worker, initargs=(fn, fn_kwargs)) as pool:
        yield _in_windows(pool, batches, 4 * num_proc)


def _in_windows(pool, batches, size: int):
    """`pool.imap` reads its whole input at once; handing it `size` batches at a time keeps
    the memory to a window of batches."""
    from itertools import islice

    while window := list(islice(batches, size)):
        yield from pool.imap(_encode_in_worker, window)


_WORKER: dict = {}


def _init_worker(fn, fn_kwargs: dict) -> None:
    # A forked worker inherits the command's handlers, and `finetune` turns SIGTERM into an
    # exception (flows/cli.py). Pool.terminate's SIGTERM can land just before the worker
    # blocks on the task queue's lock, where a Python handler never runs: the worker then
    # waits forever and the stage with it (seen once in a test run). Workers die on SIGTERM
    # as processes do by default; Ctrl-C is the parent's to handle, which then ends the pool.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(fn=fn, fn_kwargs=fn_kwargs)


def _encode_in_worker(batch):
    return _encode_batch(batch, _WORKER["fn"], _WORKER["fn_kwargs"])


def _encode_batch(batch, fn, fn_kwargs: dict):
    """One record batch through the type's encoder, as an Arrow table typed as datasets'
    writer types a map's output (`input_ids` as int32, the rest as inferred)."""
    from datasets.arrow_writer import OptimizedTypedSequence

    out = fn(batch.to_pydict(), **fn_kwargs)
    return pa.table({name: pa.array(OptimizedTypedSequence(values, col=name))
                     for name, values in out.items()})


def _counts_of(table) -> pd.DataFrame:
    """Per-row lengths straight from the Arrow columns (formatting rows in Python costs
    seconds): what the contract and the stats read."""
    return pd.DataFrame({
        "n_tokens": pc.list_value_length(table["input_ids"]).to_numpy().astype("int64"),
        "n_labels": pc.list_value_length(table["labels"]).to_numpy().astype("int64"),
        "n_trainable": table["n_trainable"].to_numpy().astype("int64"),
        "truncated": table["truncated"].to_numpy(zero_copy_only=False).astype(bool),
    })


def _totals(ds) -> "Totals":
    """A tokenized dataset's totals, read batch by batch (a mixture's rows are indices into
    its sources: taking them whole would copy every token)."""
    totals = Totals()
    columns = ds.select_columns(["input_ids", "labels", "n_trainable", "truncated"])
    for table in columns.with_format("arrow").iter(10_000):
        totals.add(_counts_of(table))
    return totals


@dataclass
class Totals:
    """A split's token statistics, added up batch by batch: nothing kept per row."""

    rows: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    truncated_rows: int = 0
    max_tokens: int = 0

    def add(self, counts: pd.DataFrame) -> None:
        if not len(counts):
            return
        self.rows += len(counts)
        self.tokens += int(counts["n_tokens"].sum())
        self.trainable_tokens += int(counts["n_trainable"].sum())
        self.truncated_rows += int(counts["truncated"].sum())
        self.max_tokens = max(self.max_tokens, int(counts["n_tokens"].max()))

    def stats(self, dropped: int) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "dropped_rows": dropped,
            "tokens": self.tokens,
            "trainable_tokens": self.trainable_tokens,
            "truncated_rows": self.truncated_rows,
            "max_tokens": self.max_tokens,
            "mean_tokens": round(self.tokens / self.rows, 2) if self.rows else 0.0,
        }


def _json_of(value) -> str:
    """An encoder argument that is not plain JSON, as text that changes when it does."""
    to_json = getattr(value, "to_json_string", None)
    if to_json is None:
        raise TypeError(f"{type(value).__name__}: not a JSON value or a processor")
    return to_json()


def _fingerprint(file: Path, tok, bos: int | None, max_len: int, model_ref: str,
                 kwargs: dict, datatype) -> str:
    """A content-derived datasets fingerprint, so `state.json` (and the DVC hash of the
    tokenized folder) is identical when the same inputs are tokenized again, on any machine.
    datasets would otherwise draw a random one (it cannot hash the tokenizer object)."""
    import hashlib

    h = hashlib.sha256()
    with open(file, "rb") as fh:  # in blocks: a split can be larger than memory
        while block := fh.read(1 << 20):
            h.update(block)
    h.update(json.dumps([max_len, bos, tok.eos_token_id, len(tok), model_ref]).encode())
    # a processor among them (a vision-language model's): its own configuration's JSON
    h.update(json.dumps(kwargs, sort_keys=True, default=_json_of).encode())
    h.update(Path(__file__).read_bytes())
    from finetune.datatypes import encoding

    for source in (Path(encoding.__file__), *datatype.source_files()):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]
