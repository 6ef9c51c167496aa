"""Stage 3, tokenize: formatted rows -> `data/tokenized/{train,test}` (Arrow) + token stats.

Tokenization happens here, once, never on the training ranks, with each source's dataset type's
encoder (finetune.datatypes): input_ids and labels, -100 where nothing is trained (the prompt,
the user turns), sequences truncated to `max_seq_length`. Rows left with no trainable token
(the prompt fills the window) are dropped and counted; above `data.max_dropped_fraction` the
stage fails instead of training on nothing, the silent failure TRL users report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from engine.modeling.labels import read_labels, write_labels
from engine.modeling.model import max_positions
from finetune.datatypes import DataContext
from finetune.datatypes.base import requires_trainable
from finetune.errors import PipelineError
from finetune.files import atomic_dir, write_json_atomic
from finetune.workspace import Workspace
from tasks.contracts import validate_tokenized
from tasks.format import check_dropped, data_context
from tasks.mixture import mix
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
        splits: dict[str, list] = {}  # role -> [(source name, tokenized split)]
        for name, part in data.parts():
            formatted = ws.layout.formatted / name if name else ws.layout.formatted
            for file in sorted(formatted.glob("*.parquet")):
                role = f"{name}/{file.stem}" if name else file.stem  # how errors name it
                ds, split_stats = _tokenize_file(file, part.datatype, ctx, role, ws)
                splits.setdefault(file.stem, []).append((name, ds))
                if name:
                    stats.setdefault("sources", {}).setdefault(name, {})[file.stem] = split_stats
                else:
                    stats[file.stem] = split_stats
        for role, parts in splits.items():
            if data.sources:
                ds = mix(parts, data, role, stats["sources"])
                stats[role] = _stats(_counts(ds), sum(
                    stats["sources"][n][role]["dropped_rows"] for n, _ in parts))
            else:
                ds = parts[0][1]
            ds.save_to_disk(str(staging / role))
            out[role] = ws.layout.tokenized / role
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


def _tokenize_file(file: Path, datatype, ctx: DataContext, role: str, ws: Workspace):
    """One formatted split -> (tokenized split, its stats), rows without a trainable token
    dropped (up to data.max_dropped_fraction) and the result checked."""
    import datasets

    data = ws.config.data
    fn, kwargs = datatype.encoder(ctx)
    tok = ctx.tokenizer
    ds = datasets.Dataset.from_pandas(pd.read_parquet(file), preserve_index=False)
    model = ws.config.model  # a GGUF base's tokenizer is its file's
    model_ref = "/".join(filter(None, (model.name_or_path, model.gguf_file)))
    fingerprint = _fingerprint(file, tok, ctx.bos, data.max_seq_length, model_ref, kwargs,
                               datatype)
    ds = ds.map(
        fn,
        batched=True,
        num_proc=_pool_size(data.num_proc, len(ds)),
        remove_columns=ds.column_names,
        fn_kwargs={"tok": tok, **kwargs},
        desc=f"tokenize {role}",
        load_from_cache_file=False,
        new_fingerprint=fingerprint,
    )
    counts = _counts(ds)
    trainable = requires_trainable(datatype.targets)  # a prompt-only row trains no token
    dropped = 0
    if trainable:
        ds, counts, dropped = _drop_untrainable(ds, counts, role, data.max_dropped_fraction,
                                                datatype.untrainable, fingerprint)
    validate_tokenized(counts, data.max_seq_length, f"tokenize split '{role}'", trainable,
                       aligned=not datatype.task.encoder_decoder)
    # per-example lengths for group_by_length (training.length_column_name), computed once
    ds = ds.add_column("length", counts["n_tokens"].tolist(),
                       new_fingerprint=f"{fingerprint}-length")
    return ds, _stats(counts, dropped)


def _pool_size(num_proc: int, rows: int) -> int | None:
    """datasets >= 3 starts a worker pool for any num_proc >= 1, even 1: measured 2.5x slower
    than mapping in this process (bench/suite.py tokenize). None means in-process."""
    return num_proc if num_proc > 1 and rows >= 2 * num_proc else None


def _counts(ds) -> pd.DataFrame:
    """Per-row lengths straight from the Arrow columns: reading `ds["input_ids"]` in
    Python formats every row (2.4 s of a 12 s stage on 20k Alpaca rows)."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    return pd.DataFrame({  # the contract and the stats read these
        "n_tokens": pc.list_value_length(table["input_ids"]).to_numpy().astype("int64"),
        "n_labels": pc.list_value_length(table["labels"]).to_numpy().astype("int64"),
        "n_trainable": table["n_trainable"].to_numpy(),
        "truncated": table["truncated"].to_numpy(),
    })


def _fingerprint(file: Path, tok, bos: int | None, max_len: int, model_ref: str,
                 kwargs: dict, datatype) -> str:
    """A content-derived datasets fingerprint, so `state.json` (and the DVC hash of the
    tokenized folder) is identical when the same inputs are tokenized again, on any machine.
    datasets would otherwise draw a random one (it cannot hash the tokenizer object)."""
    import hashlib

    h = hashlib.sha256(file.read_bytes())
    h.update(json.dumps([max_len, bos, tok.eos_token_id, len(tok), model_ref]).encode())
    h.update(json.dumps(kwargs, sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    from finetune.datatypes import encoding

    for source in (Path(encoding.__file__), *datatype.source_files()):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def _drop_untrainable(ds, counts: pd.DataFrame, role: str, max_fraction: float, why: str,
                      fingerprint: str):
    keep = counts["n_trainable"] > 0
    dropped = int(len(counts) - keep.sum())
    check_dropped(dropped, len(counts), max_fraction, f"tokenize split '{role}'",
                  f"no trainable token ({why})",
                  None if keep.all() else int(keep.idxmin()),
                  "raise data.max_seq_length or shorten the prompts")
    if dropped:
        ds = ds.select(counts.index[keep].tolist(), new_fingerprint=f"{fingerprint}-kept")
        counts = counts[keep].reset_index(drop=True)
    return ds, counts, dropped


def _stats(counts: pd.DataFrame, dropped: int) -> dict[str, Any]:
    return {
        "rows": len(counts),
        "dropped_rows": dropped,
        "tokens": int(counts["n_tokens"].sum()),
        "trainable_tokens": int(counts["n_trainable"].sum()),
        "truncated_rows": int(counts["truncated"].sum()),
        "max_tokens": int(counts["n_tokens"].max()),
        "mean_tokens": round(float(counts["n_tokens"].mean()), 2),
    }
