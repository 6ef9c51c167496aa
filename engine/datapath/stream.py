"""Micro-batches from an example stream (a streamed train split), resumable exactly.

The stream has no length and cannot be indexed, so the map-style scheme of engine.datapath.data
(permute, slice) becomes its streaming twin, accelerate's IterableDatasetShard scheme: every rank
reads the same stream, cuts it into global batches of micro x world consecutive examples and
keeps slice `rank`. So 2 ranks x batch b see what 1 rank x batch 2b sees, as in
engine.datapath.data, and the position is still (epoch, micro-batches consumed). Resuming
re-reads the stream up to that position (the shuffle buffer cannot be saved, so skipping is the
only exact way): exact, at the cost of reading the consumed part again. A trailing incomplete
global batch ends the epoch (drop_last); the next epoch reshuffles.
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator

import torch

from finetune.errors import PipelineError

#: epoch -> that epoch's examples ({input_ids, labels}), in a fixed order per epoch
ExampleSource = Callable[[int], Iterable[dict]]


class StreamedBatches:
    def __init__(self, open_epoch: ExampleSource, micro_batch_size: int,
                 rank: int, world_size: int, collate_fn: Callable,
                 epoch_len: float = float("inf")):
        self.open_epoch, self.collate_fn = open_epoch, collate_fn
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        #: micro-batches per epoch (training.epoch_train_steps x accumulation), or the stream's end
        self.epoch_len = epoch_len

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size

    def micro_batches(self, epoch: int, start: int) -> Iterator[dict]:
        """This rank's micro-batches from (epoch, start) on, epoch after epoch."""
        b, g = self.micro_batch_size, self.global_batch
        while True:
            examples = iter(self.open_epoch(epoch))
            skipped = sum(1 for _ in islice(examples, start * g))
            if skipped < start * g:
                raise PipelineError(
                    f"streamed train split: epoch {epoch} has {skipped} examples, fewer than the "
                    f"checkpoint's position ({start} global batches of {g}); the source changed "
                    "since the checkpoint was written")
            index, chunk = start, []
            while index < self.epoch_len and len(chunk := list(islice(examples, g))) == g:
                rows = chunk[self.rank * b : (self.rank + 1) * b]
                batch = self.collate_fn(rows)
                batch["key"] = torch.tensor([epoch, index])
                batch["real_tokens"] = torch.tensor(sum(len(r["input_ids"]) for r in rows))
                batch["examples"] = torch.tensor(len(rows))
                yield batch
                index += 1
            if index == 0:
                raise PipelineError(
                    f"streamed train split yields {len(chunk)} trainable examples, fewer than "
                    f"one global batch ({g}); lower per_device_train_batch_size")
            epoch, start = epoch + 1, 0
