"""Stage 3, tokenize: formatted pairs -> `data/tokenized/{train,test}` (Arrow) + token stats.

Tokenization happens here, once, never on the training ranks. Labels are completion-only
(prompt tokens are -100), EOS is appended and trained, sequences are truncated to
`max_seq_length`. Rows left with no trainable token (prompt fills the window) are dropped and
counted; above `data.max_dropped_fraction` the stage fails instead of training on nothing,
the silent failure TRL users report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from engine.model import bos_prefix_id, load_tokenizer, max_positions
from finetune.errors import PipelineError
from finetune.workspace import Workspace, atomic_dir, write_json_atomic
from tasks.contracts import validate_tokenized
from tasks.stream import carry_manifest

IGNORE_INDEX = -100


def tokenize(ws: Workspace) -> dict[str, Path]:
    import datasets

    data = ws.config.data
    limit = max_positions(ws.config.model, ws.root)
    if limit and data.max_seq_length > limit:
        raise PipelineError(
            f"data.max_seq_length {data.max_seq_length} exceeds the model's "
            f"max_position_embeddings {limit}; set data.max_seq_length <= {limit}"
        )
    tok = load_tokenizer(ws.config.model, ws.root)
    if tok.eos_token_id is None:
        raise PipelineError(f"model.name_or_path {ws.config.model.name_or_path}: tokenizer has no EOS token")
    bos = bos_prefix_id(tok)
    tok.model_max_length = int(1e9)  # we truncate ourselves; silence the length warning
    stats: dict[str, Any] = {}
    out: dict[str, Path] = {}
    with atomic_dir(ws.layout.tokenized) as staging:
        for file in sorted(ws.layout.formatted.glob("*.parquet")):
            role = file.stem
            ds = datasets.Dataset.from_pandas(pd.read_parquet(file), preserve_index=False)
            fingerprint = _fingerprint(file, tok, bos, data.max_seq_length,
                                       ws.config.model.name_or_path)
            ds = ds.map(
                encode_batch,
                batched=True,
                num_proc=data.num_proc if len(ds) >= 2 * data.num_proc else None,
                remove_columns=ds.column_names,
                fn_kwargs={"tok": tok, "bos": bos, "max_len": data.max_seq_length},
                desc=f"tokenize {role}",
                load_from_cache_file=False,
                new_fingerprint=fingerprint,
            )
            counts = pd.DataFrame({  # each column read once; contract and stats use these
                "n_tokens": [len(x) for x in ds["input_ids"]],
                "n_labels": [len(x) for x in ds["labels"]],
                "n_trainable": ds["n_trainable"],
                "truncated": ds["truncated"],
            })
            ds, counts, dropped = _drop_untrainable(ds, counts, role, data.max_dropped_fraction,
                                                    fingerprint)
            validate_tokenized(counts, data.max_seq_length, f"tokenize split '{role}'")
            ds.save_to_disk(str(staging / role))
            stats[role] = _stats(counts, dropped)
            out[role] = ws.layout.tokenized / role
        carry_manifest(ws.layout.formatted, staging, max_seq_length=data.max_seq_length,
                       model=ws.config.model.name_or_path, revision=ws.config.model.revision)
    if not out and not data.streaming:  # streaming without a test split: nothing to tokenize
        raise PipelineError(f"{ws.layout.formatted}: no formatted splits; run format first")
    write_json_atomic(ws.layout.metrics / "tokenize.json", stats)
    return out


def encode_batch(batch: dict[str, list], tok, bos: int | None, max_len: int) -> dict[str, list]:
    """Prompt and completion are tokenized apart so the mask boundary is exact."""
    prompts = tok(batch["prompt"], add_special_tokens=False)["input_ids"]
    completions = tok(batch["completion"], add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    out: dict[str, list] = {"input_ids": [], "labels": [], "n_trainable": [], "truncated": []}
    for p, c in zip(prompts, completions):
        head = ([bos] if bos is not None else []) + p
        ids = head + c + [eos]
        labels = [IGNORE_INDEX] * len(head) + c + [eos]
        truncated = len(ids) > max_len
        ids, labels = ids[:max_len], labels[:max_len]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["n_trainable"].append(sum(1 for x in labels if x != IGNORE_INDEX))
        out["truncated"].append(truncated)
    return out


def _fingerprint(file: Path, tok, bos: int | None, max_len: int, model_ref: str) -> str:
    """A content-derived datasets fingerprint, so `state.json` (and the DVC hash of the
    tokenized folder) is identical when the same inputs are tokenized again, on any machine.
    datasets would otherwise draw a random one (it cannot hash the tokenizer object)."""
    import hashlib

    h = hashlib.sha256(file.read_bytes())
    h.update(json.dumps([max_len, bos, tok.eos_token_id, len(tok), model_ref]).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def _drop_untrainable(ds, counts: pd.DataFrame, role: str, max_fraction: float,
                      fingerprint: str):
    total = len(counts)
    keep = counts["n_trainable"] > 0
    dropped = int(total - keep.sum())
    if total == 0:
        raise PipelineError(f"tokenize split '{role}': no rows")
    if dropped / total > max_fraction:
        first = int(keep.idxmin())
        raise PipelineError(
            f"tokenize split '{role}': {dropped}/{total} rows have no trainable token "
            f"(prompt fills max_seq_length or completion empty; first: row {first}); "
            f"above data.max_dropped_fraction {max_fraction}: raise data.max_seq_length or "
            "shorten the prompts"
        )
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
