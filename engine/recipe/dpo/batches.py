"""A preference run's batches: b pairs as 2b rows, chosen sides first (TRL's concatenated
forward: one forward of a model scores both sides of every pair)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.datapath.data import MODEL_COLUMNS

#: the split columns a preference run reads: the chosen side as input_ids/labels, and the
#: rejected side next to it (finetune.datatypes.preference writes both)
PAIR_COLUMNS = (*MODEL_COLUMNS, "rejected_input_ids", "rejected_labels")


def collate_pairs(rows: list[dict], collate_fn: Callable[[list[dict]], dict]) -> dict:
    """A micro-batch of b pairs as 2b rows, the chosen sides first, collated by the run's own
    collator (padding, packing: whatever the batch layout is); `pairs` = b."""
    sides = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows] + [
        {"input_ids": r["rejected_input_ids"], "labels": r["rejected_labels"]} for r in rows]
    batch = collate_fn(sides)
    batch["pairs"] = torch.tensor(len(rows))
    return batch
