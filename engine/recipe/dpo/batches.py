"""A preference run's batches: b pairs as 2b rows, chosen sides first (TRL's concatenated
forward: one forward of a model scores both sides of every pair)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.datapath.data import MODEL_COLUMNS

#: the split columns a preference run reads: the chosen side as input_ids/labels, and the
#: rejected side next to it (finetune.datatypes.preference writes both)
PAIR_COLUMNS = (*MODEL_COLUMNS, "rejected_input_ids", "rejected_labels")
#: the prefix of a rejected side's own columns
REJECTED = "rejected_"


def collate_pairs(rows: list[dict], collate_fn: Callable[[list[dict]], dict]) -> dict:
    """A micro-batch of b pairs as 2b rows, the chosen sides first, collated by the run's own
    collator (padding, packing: whatever the batch layout is); `pairs` = b. A column
    `rejected_NAME` is the rejected side's NAME; the row's other columns (a vision pair's
    images: the model kind's) belong to both sides."""
    def side(row: dict, rejected: bool) -> dict:
        own = {k: v for k, v in row.items() if not k.startswith(REJECTED)}
        if rejected:
            own.update({k[len(REJECTED):]: v for k, v in row.items()
                        if k.startswith(REJECTED)})
        return own

    sides = [side(r, False) for r in rows] + [side(r, True) for r in rows]
    batch = collate_fn(sides)
    batch["pairs"] = torch.tensor(len(rows))
    return batch
