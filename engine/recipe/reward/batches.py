"""A reward run's batches: the preference run's (b pairs as 2b rows, chosen first:
engine.recipe.dpo.batches) with each pair's `margin` next to them when the split has one."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.recipe.dpo.batches import PAIR_COLUMNS, collate_pairs

#: the split columns a reward run reads: the pairs, and TRL's optional per-pair margin
REWARD_COLUMNS = (*PAIR_COLUMNS, "margin")


def collate_rewarded(rows: list[dict], collate_fn: Callable[[list[dict]], dict]) -> dict:
    """`collate_pairs`, plus `margin` ([b], float32) when the rows carry one."""
    batch = collate_pairs(rows, collate_fn)
    if "margin" in rows[0]:
        batch["margin"] = torch.tensor([r["margin"] for r in rows], dtype=torch.float32)
    return batch
