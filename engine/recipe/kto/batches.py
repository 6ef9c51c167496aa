"""A KTO run's batches: b labelled completions, and b mismatched rows for the KL estimate.

The KL rows are TRL's: each row's prompt followed by the previous row's completion in the
micro-batch (row 0 takes the last one's), (x_1, y_b), (x_2, y_1), ..., so the completions
that estimate the KL term are the ones whose rewards the batch trains, each after another
prompt."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.datapath.data import IGNORE_INDEX, MODEL_COLUMNS
from finetune.datatypes.unpaired_preference import LABEL_COLUMN

#: the split columns a KTO run reads: the completion as input_ids/labels, and its label
KTO_COLUMNS = (*MODEL_COLUMNS, LABEL_COLUMN)
#: the prefix of the mismatched rows' collated tensors in a batch
KL = "kl_"


def _prompt_and_completion(row: dict) -> tuple[list[int], list[int]]:
    """A row's prompt tokens and its trained completion tokens (split at the label mask)."""
    labels = row["labels"]
    start = next((i for i, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
    return row["input_ids"][:start], row["input_ids"][start:]


def collate_unpaired(rows: list[dict], collate_fn: Callable[[list[dict]], dict],
                     max_len: int) -> dict:
    """A micro-batch of b rows collated by the run's own collator, `desirable` (bool [b]), and
    the mismatched rows collated alike under `kl_` keys (cut to `max_len`: another row's
    completion may be longer)."""
    batch = collate_fn([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    split = [_prompt_and_completion(r) for r in rows]
    shifted = [split[-1][1]] + [completion for _, completion in split[:-1]]
    mismatched = [{"input_ids": (prompt + completion)[:max_len],
                   "labels": ([IGNORE_INDEX] * len(prompt) + completion)[:max_len]}
                  for (prompt, _), completion in zip(split, shifted)]
    batch.update({KL + k: v for k, v in collate_fn(mismatched).items()})
    batch["desirable"] = torch.tensor([bool(r[LABEL_COLUMN]) for r in rows])
    return batch


def mismatched(batch: dict) -> dict:
    """The batch of the mismatched rows (the `kl_` keys, unprefixed)."""
    return {k[len(KL):]: v for k, v in batch.items() if k.startswith(KL)}
