"""Stage 2, format: raw rows -> `data/formatted/{train,test}.parquet`, each source's rows as its
dataset type makes them (finetune.datatypes): at least a prompt and a completion, which the
evaluate stage prompts with and compares against.

Rows with nothing to learn (an empty completion, a conversation with an empty assistant turn,
a classification row without a label) are dropped and counted, as tokenize drops rows left
with no trainable token: `data/metrics/format.json` has the counts, and a split where more than
`data.max_dropped_fraction` is dropped fails the stage. A classifier's label map is made here,
from every training source, and written next to the splits (`labels.json`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from finetune.config.data import DataConfig
from finetune.datatypes import DataContext
from finetune.datatypes.base import class_names
from finetune.datatypes.contract import check_frame
from finetune.errors import PipelineError
from finetune.files import atomic_dir, write_json_atomic
from finetune.parquet_batches import RowGroupWriter, frames
from finetune.workspace import Workspace
from tasks.stream_manifest import carry_manifest


def format_prompts(ws: Workspace) -> dict[str, Path]:
    """Run the stage; each source of a mixture is formatted with its own keys into its own
    folder (`<source>/<split>` in the result)."""
    top = ws.config.data
    ctx = data_context(ws)
    out: dict[str, Path] = {}
    stats: dict = {}
    with atomic_dir(ws.layout.formatted) as staging:
        ctx.labels = label_map(ws, top)
        if ctx.labels is not None:
            from engine.prepare import write_labels

            out["labels"] = ws.layout.formatted / write_labels(staging, ctx.labels).name
        for name, data in top.parts():
            folder = staging / name if name else staging
            folder.mkdir(exist_ok=True)
            raw = ws.layout.raw / name if name else ws.layout.raw
            source_stats = stats.setdefault("sources", {}).setdefault(name, {}) if name else stats
            for raw_file in sorted(raw.glob("*.parquet")):
                role = raw_file.stem
                split = f"{name}/{role}" if name else role  # how errors name it
                with RowGroupWriter(folder / f"{role}.parquet") as writer:
                    source_stats[role] = format_batches(data, frames(raw_file), split, ctx,
                                                        top.max_dropped_fraction, writer.write)
                out[f"{name}/{role}" if name else role] = ws.layout.formatted / (
                    folder / f"{role}.parquet").relative_to(staging)
        if top.sources:  # the mixture's totals per split
            for role in {r for s in stats["sources"].values() for r in s}:
                parts = [s[role] for s in stats["sources"].values() if role in s]
                stats[role] = {k: sum(p[k] for p in parts) for k in ("rows", "dropped_rows")}
        carry_manifest(ws.layout.raw, staging, **applied_keys(top))
    if not out and not top.streaming:  # streaming without a test split: nothing to format
        raise PipelineError(f"{ws.layout.raw}: no raw splits; run the download stage first")
    write_json_atomic(ws.layout.metrics / "format.json", stats)
    return out


def format_split(data: DataConfig, frame: pd.DataFrame, split: str, ctx: DataContext,
                 max_fraction: float) -> tuple[pd.DataFrame, dict]:
    """One raw split in one frame -> its formatted rows (checked against the type's contract)
    and counts."""
    parts: list[pd.DataFrame] = []
    stats = format_batches(data, [frame], split, ctx, max_fraction, parts.append)
    return pd.concat(parts, ignore_index=True), stats


def format_batches(data: DataConfig, batches: Iterable[pd.DataFrame], split: str,
                   ctx: DataContext, max_fraction: float,
                   write: Callable[[pd.DataFrame], None]) -> dict:
    """One raw split, frame by frame, -> its formatted rows, each frame's checked against the
    type's contract and handed to `write`; returns the split's counts. Row numbers stay the
    split's: the type is told each frame's first row, and the contract's row is the kept
    row's number in the whole formatted split."""
    datatype = data.datatype
    schema = datatype.formatted_schema()
    where = f"format split '{split}'"
    total = kept = dropped = 0
    first, reason, kinds = None, "nothing to train on", Counter()
    for frame in batches:
        formatted = datatype.format(frame, split, ctx, total)
        if formatted.dropped and first is None:
            first, reason = formatted.first, formatted.reason
        if formatted.reasons:  # dropped for several reasons (a row contract's rule among them)
            kinds.update(r.split(" (")[0] for r in formatted.reasons.values())
        dropped += len(formatted.dropped)
        rows = formatted.rows
        rows.index = pd.RangeIndex(kept, kept + len(rows))  # the contract names this row
        check_frame(schema, rows, where)
        write(rows.reset_index(drop=True))
        kept += len(rows)
        total += len(frame)
    if kinds:  # the reasons with their counts, as Formatted.with_reasons words them
        reason = "; ".join(f"{kind} ({n})" if len(kinds) > 1 else kind
                           for kind, n in kinds.most_common())
    check_dropped(dropped, total, max_fraction, where, reason, first)
    stats = {"rows": kept, "dropped_rows": dropped}
    if kinds:
        stats["dropped_by_reason"] = dict(kinds.most_common())
    return stats


def check_dropped(dropped: int, total: int, max_fraction: float, where: str, reason: str,
                  first: int | str | None, fix: str = "clean the data or raise "
                  "data.max_dropped_fraction") -> None:
    """The rule format and tokenize share: rows with nothing to learn are dropped, unless a
    larger fraction than `data.max_dropped_fraction` of the split is (then the data or the
    settings are wrong, and training on the rest would hide it)."""
    if total == 0:
        raise PipelineError(f"{where}: no rows")
    if dropped / total > max_fraction:
        raise PipelineError(
            f"{where}: {dropped}/{total} rows have {reason} (first: row {first}); above "
            f"data.max_dropped_fraction {max_fraction}: {fix}")


def data_context(ws: Workspace) -> DataContext:
    """What the types get from a data stage: the root, the tokenizer, loaded on first use
    (with our own truncation: its length limit is not the stage's), and the model kind's
    processor around it."""
    from engine.prepare import load_tokenizer

    def tokenizer():
        tok = load_tokenizer(ws.config.model, ws.root)
        tok.model_max_length = int(1e9)
        return tok

    def processor(tok):
        from engine.prepare import kind_of

        return kind_of(ws.config).processor(tok, ws.config.model, ws.root)

    return DataContext(ws.root, tokenizer, load_processor=processor,
                       load_tools=lambda: method_tool_schemas(ws.config))


def method_tool_schemas(cfg) -> list[dict] | dict[str, list[dict]] | None:
    """The schemas of the tools the method's rollouts call (grpo.tools, and the methods of
    grpo.environment_factory's environments), rendered into the prompts as TRL renders its
    `tools=`: one list for every row, or one per environment name (each row's `environment`
    column chooses); None when the method names none."""
    from finetune.config.methods import method_of

    method = method_of(cfg.training.type)
    refs = method.prompt_tools(cfg) if method.prompt_tools else None
    environments = method.prompt_environments(cfg) if method.prompt_environments else None
    if not refs and not environments:
        return None
    from engine.prepare import rollout_tool_schemas

    return rollout_tool_schemas(refs or [], environments, method.own_sections[0])


def label_map(ws: Workspace, top: DataConfig) -> list[str] | None:
    """A classifier's class names in id order: `data.labels`, else the labels of every
    training source's raw train split; None for a model without classes."""
    if top.targets != "labels":
        return None
    if top.labels:
        return list(top.labels)
    found: set[str] = set()
    for name, data in top.parts():
        if top.eval_only(name):
            continue
        train = (ws.layout.raw / name if name else ws.layout.raw) / "train.parquet"
        if not train.exists():
            raise PipelineError(f"{train} missing; run the download stage first")
        for frame in frames(train):
            found.update(data.datatype.label_values(frame))
    return class_names(found, None)


def applied_keys(top: DataConfig) -> dict:
    """The format settings a stream's manifest carries on (its examples change with them)."""
    parts = {name or "": data.model_dump(mode="json", include=set(data.datatype.keys)
                                         | {"dataset_type"})
             for name, data in top.parts()}
    return parts[""] if "" in parts else {"sources": parts}
