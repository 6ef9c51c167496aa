"""The generation rows and their scoring, shared by the evaluate stage (tasks/evaluate.py) and
in-training evaluation (engine/recipe/sft/in_training.py), so both report the same number for
the same weights and rows.

The rows are the prompts and references each source's dataset type makes of its formatted
test split (`eval_rows`), the sources in order (column `part` numbering them), the first
`eval.max_generation_samples` of them. In-training evaluation generates on a seeded subset of
those rows (`training_subset`). The scoring asks each source's type (`score`, `row_scores`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from finetune.datatypes.base import DataContext
from finetune.errors import PipelineError


def formatted_test(formatted: Path, name: str | None) -> Path:
    """One source's formatted test split inside the format stage's folder `formatted` (a
    mixture's sources each in their own subfolder)."""
    return (formatted / name if name else formatted) / "test.parquet"


def generation_rows(cfg, formatted: Path) -> pd.DataFrame:
    """The prompts and references each source's type makes of its formatted test rows (the
    sources in order, column `part` numbering them), the first `eval.max_generation_samples`
    of them."""
    frames = []
    for i, (name, data) in enumerate(cfg.data.parts()):
        test = formatted_test(formatted, name)
        if not test.exists():
            raise PipelineError(f"{test} missing; run the format stage first")
        frames.append(data.datatype.eval_rows(pd.read_parquet(test)).assign(part=i))
    rows = pd.concat(frames, ignore_index=True)
    limit = cfg.eval.max_generation_samples
    return rows.head(limit) if limit else rows


def training_subset(rows: pd.DataFrame, samples: int, seed: int) -> pd.DataFrame:
    """The rows in-training evaluation generates on: the first `samples` positions of a
    permutation of `rows` seeded by `seed` (training.seed), kept in the rows' own order, so
    every evaluation of a run sees the same rows and `samples` >= len(rows) is `rows` itself
    (the evaluate stage's rows, in its order: the same scores and bootstrap stderrs)."""
    order = np.random.default_rng(seed).permutation(len(rows))[:samples]
    return rows.iloc[np.sort(order)].reset_index(drop=True)


def score_generations(cfg, rows: pd.DataFrame, predictions: list[str], ctx: DataContext
                      ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each source's type scores its own rows; sources of one type are scored together, and
    several types' scores (means over rows) are combined weighted by their rows. Beside the
    scores, each metric's per-row values where their mean is the score: one type's
    `row_scores`, each over the rows it scores (a chat type's tool-call metrics over the
    turns that call tools, its text metrics over the others); with several types, a metric
    every type has for all of its rows (the others, and metrics of the whole set such as
    macro-F1, get none)."""
    parts = cfg.data.parts()
    groups: dict[type, list[int]] = {}
    for i, part in enumerate(rows["part"]):
        groups.setdefault(type(parts[part][1].datatype), []).append(i)
    scored = []
    for positions in groups.values():
        datatype = parts[int(rows["part"].iloc[positions[0]])][1].datatype
        args = ([predictions[i] for i in positions], rows["reference"].iloc[positions].tolist(),
                cfg.eval, ctx)
        per_row = datatype.row_scores(*args) if cfg.eval.bootstrap_samples else {}
        scored.append((positions, datatype.score(*args), per_row))
    if len(scored) == 1:
        _, scores, per_row = scored[0]
        return scores, per_row
    combined = {key: sum(len(p) * scores.get(key, 0.0) for p, scores, _ in scored) / len(rows)
                for key in {k for _, scores, _ in scored for k in scores}}
    full = {}
    for key in combined:
        if all(len(per_row.get(key, ())) == len(p) for p, _, per_row in scored):
            values = [0.0] * len(rows)
            for positions, _, per_row in scored:
                for i, v in zip(positions, per_row[key]):
                    values[i] = v
            full[key] = values
    return combined, full


def metric_names(names) -> list[str]:
    """`names` with the groups spelled out as the metrics they report (rouge: rouge1, rouge2,
    rougeL; tool_calls: tool_name_match, tool_arguments_match)."""
    from finetune.datatypes.metrics import ROUGE_KEYS, TOOL_CALL_KEYS

    out: list[str] = []
    for name in names:
        out += (ROUGE_KEYS if name == "rouge" else TOOL_CALL_KEYS if name == "tool_calls"
                else (name,))
    return out


def generation_metric_names(cfg, chosen: bool = True) -> tuple[str, ...]:
    """The metrics `eval.generation_metrics` makes the sources' types report (exact_match,
    rouge1/2/L, tool_name_match and tool_arguments_match where a type reports them): what
    in-training evaluation logs as `eval_<name>`; with `chosen` and a list in
    `eval.during_training_metrics`, only those it names (`chosen=False`: all of them, what
    the list may name)."""
    reported = {m for _, part in cfg.data.parts() for m in part.datatype.reported_metrics()}
    names = tuple(m for m in metric_names(cfg.eval.generation_metrics) if m in reported)
    picked = cfg.eval.during_training_metrics
    if chosen and isinstance(picked, list):
        keep = set(metric_names(picked))
        names = tuple(m for m in names if m in keep)
    return names
