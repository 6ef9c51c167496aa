"""Make every trainer of a benchmark train on HF group_by_length's batches, in one sequence.

HF Trainer's `train_sampling_strategy="group_by_length"` is its own answer to padding: it cuts
a seeded permutation into mega-batches, sorts each by length and cuts it into batches (the
longest batch first). A fair comparison runs HF at that setting, and a correct one has every
trainer see the same batches in the same order, so that equal losses show the runs are the
same computation. Our engine reads a split in its own seeded order
(`engine.datapath.data.ShardedBatches`); `read_in_our_order` lays the rows out so that order
reads HF's batches, and returns the order for the peers, which read the split sequentially.
Needs only torch, transformers and datasets (it runs on the GPU machine too).
"""

from __future__ import annotations

import shutil
from pathlib import Path


def our_order(n_rows: int, batch: int, steps: int, seed: int) -> list[int]:
    """The first `steps` batches of our engine's order over `n_rows` rows (one rank, epoch 0)."""
    from engine.datapath.data import ShardedBatches

    per_epoch = ShardedBatches(n_rows, batch, 0, 1, seed).epoch(0)
    if steps > len(per_epoch):
        raise SystemExit(f"{steps} steps exceed one epoch ({len(per_epoch)}); lower --steps")
    return per_epoch[:steps].ravel().tolist()  # plain ints: the order travels as JSON


def hf_grouped_batches(lengths: list[int], batch: int, seed: int) -> list[list[int]]:
    """HF's group_by_length batches over rows of these lengths (its own function and seed)."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    grouped = get_length_grouped_indices(lengths, batch,
                                         generator=torch.Generator().manual_seed(seed))
    return [grouped[i:i + batch] for i in range(0, len(grouped) - batch + 1, batch)]


def read_in_our_order(train_split: Path, sequence: list[int], batch: int, steps: int,
                      seed: int) -> list[int]:
    """Replace `train_split` with the rows of `sequence` (steps x batch row indices, a peer's
    batches in its order) laid out so that our engine's seeded order over the new split reads
    them in exactly those batches; returns that order (for the peers to read the new split
    sequentially in it)."""
    import datasets

    if len(sequence) != steps * batch:
        raise ValueError(f"{len(sequence)} rows for {steps} batches of {batch}")
    split = datasets.load_from_disk(str(train_split))
    order = our_order(len(sequence), batch, steps, seed)  # a permutation: one epoch exactly
    layout = [0] * len(sequence)
    for k, position in enumerate(order):
        layout[position] = sequence[k]  # our k-th row read is the peer's k-th
    staged = train_split.with_name(train_split.name + "-laid-out")
    split.select(layout).save_to_disk(str(staged))
    shutil.rmtree(train_split)
    staged.rename(train_split)
    return order
