"""Batches for one rank: a seeded permutation per epoch, cut into global batches, sharded.

Global batch k is `perm[k*B : (k+1)*B]` with B = micro-batch x world size, and rank r takes the
r-th contiguous slice. So 2 ranks x batch b see exactly the examples 1 rank x batch 2b sees,
which is what makes DDP vs single runs comparable bit for bit, and the position in an epoch is
just "batches consumed": enough to resume exactly. An epoch holds whole optimizer steps
(micro x world x accumulation examples each); the remainder is dropped, so no step straddles
two epochs and batch b x accumulation k sees exactly what batch k*b sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ShardedBatches:
    num_examples: int
    micro_batch_size: int
    rank: int
    world_size: int
    seed: int
    accumulation: int = 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size

    def __len__(self) -> int:
        """Micro-batches per epoch on each rank (incomplete optimizer steps are dropped)."""
        return self.num_examples // (self.global_batch * self.accumulation) * self.accumulation

    def epoch(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_examples, generator=g).tolist()
        out = []
        for k in range(len(self)):
            start = k * self.global_batch + self.rank * self.micro_batch_size
            out.append(perm[start : start + self.micro_batch_size])
        return out


MODEL_COLUMNS = ["input_ids", "labels"]


def load_tokenized(path):
    """A tokenized split with only the columns the model consumes."""
    import datasets

    return datasets.load_from_disk(str(path)).select_columns(MODEL_COLUMNS)


def take_rows(dataset, indices) -> list[dict]:
    """Rows at `indices` in one Arrow take (not one lookup per row)."""
    cols = dataset[list(indices)]
    return [dict(zip(cols, values)) for values in zip(*cols.values())]


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Dynamic padding: pad to the longest row of this batch (right side)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        labels[i, :n] = torch.as_tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that contribute to the loss after the causal shift."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy; callers divide by the step's token count."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
