"""The training batches through a torch DataLoader (workers, pinning, prefetch), in the exact
order ShardedBatches defines, resumable at any (epoch, micro-batch).

The sampler yields (epoch, index-in-epoch) keys and the dataset turns a key into a collated
micro-batch, so the order stays decided in one place (engine.datapath.data) while collation runs in
worker processes. Every item carries its key: the loop's position advances only for batches it
actually consumed, never for ones a worker prefetched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from engine.datapath.data import ShardedBatches, take_rows

if TYPE_CHECKING:
    import numpy as np


class MicroBatches(Dataset):
    def __init__(self, rows, batches: ShardedBatches, collate_fn: Callable):
        self.rows, self.batches, self.collate_fn = rows, batches, collate_fn
        self._orders: dict[int, "np.ndarray"] = {}  # epoch -> [micro-batch, example] indices

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        if epoch not in self._orders:  # one permutation per epoch, per worker
            self._orders = {epoch: self.batches.epoch(epoch)}
        indices = self._orders[epoch][index].tolist()  # a micro-batch's: Python ints
        rows = take_rows(self.rows, indices)
        batch = self.collate_fn(rows)
        batch["key"] = torch.tensor([epoch, index])
        batch["rows"] = torch.tensor(indices)  # which split rows (a trainer's per-row tables)
        # every token sequence the row holds (a pair's two sides, say): the speed metrics'
        batch["real_tokens"] = torch.tensor(sum(len(v) for r in rows for k, v in r.items()
                                                if k.endswith("input_ids")))
        batch["examples"] = torch.tensor(len(rows))
        return batch


class EpochSampler(Sampler):
    """Keys of one epoch from a start index; `set_epoch` before each pass (like
    DistributedSampler), so persistent workers serve every epoch."""

    def __init__(self, per_epoch: int):
        self.per_epoch, self.epoch, self.start = per_epoch, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(self.epoch, i) for i in range(self.start, self.per_epoch)])

    def __len__(self) -> int:
        return self.per_epoch - self.start


def make_loader(rows, batches: ShardedBatches, collate_fn: Callable, cfg,
                device: torch.device) -> DataLoader:
    """`cfg`: the training section (dataloader_* keys, HF TrainingArguments names). Pinning
    only means something when batches are copied to an accelerator."""
    workers = cfg.dataloader_num_workers
    return DataLoader(
        MicroBatches(rows, batches, collate_fn),
        sampler=EpochSampler(len(batches)),
        batch_size=None,  # items are already micro-batches
        num_workers=workers,
        pin_memory=cfg.dataloader_pin_memory and device.type == "cuda",
        prefetch_factor=cfg.dataloader_prefetch_factor if workers else None,
        persistent_workers=cfg.dataloader_persistent_workers and workers > 0,
    )


def micro_batches(loader: DataLoader, epoch: int, start: int) -> Iterator[dict]:
    """Micro-batches from (epoch, start) on, epoch after epoch, for as long as asked."""
    while True:
        loader.sampler.set_epoch(epoch, start)
        yield from loader
        epoch, start = epoch + 1, 0


def example_lengths(train_data, column: str):
    """group_by_length's per-example lengths: the tokenized split's `column` (the tokenize
    stage writes `length`), read from the memory-mapped split as one int32 numpy array (4
    bytes a row: no Python int per row); a split tokenized before that column existed falls
    back to counting its token lists."""
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from finetune.errors import PipelineError

    ds = datasets.load_from_disk(str(train_data))
    if column not in ds.column_names and column != "length":
        raise PipelineError(f"training.length_column_name '{column}' is not a column of the "
                            f"tokenized train split (columns: {', '.join(ds.column_names)})")
    source = column if column in ds.column_names else "input_ids"
    values = ds.with_format("arrow", columns=[source])[:][source]
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        values = pc.list_value_length(values)  # a token column (QEfficient's input_ids)
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int32)


def open_train_batches(t, train_data, d, collate_fn: Callable, stream=None,
                       columns: tuple[str, ...] | None = None
                       ) -> tuple[Callable[[int, int], Iterator[dict]], int | None, float]:
    """This rank's training micro-batches for `t` (the training section): (open(epoch,
    start) -> micro-batches, optimizer steps per epoch, micro-batches per epoch). From the
    tokenized split at `train_data` (the `columns` the run reads), or from `stream` (epoch ->
    examples), whose epoch length is training.epoch_train_steps, else unknown (None, inf)."""
    import math

    from engine.datapath.data import MODEL_COLUMNS, load_tokenized
    from engine.datapath.stream import StreamedBatches
    from finetune.errors import PipelineError

    if stream is not None:
        nominal = t.epoch_train_steps  # a stream's epoch: nominal, or wherever the stream ends
        epoch_len = nominal * t.gradient_accumulation_steps if nominal else math.inf
        streamed = StreamedBatches(stream, t.per_device_train_batch_size, d.rank, d.world_size,
                                   collate_fn, epoch_len)
        return streamed.micro_batches, nominal, epoch_len
    train_ds = load_tokenized(train_data, columns or MODEL_COLUMNS)
    accum = t.gradient_accumulation_steps
    lengths = example_lengths(train_data, t.length_column_name) if t.group_by_length else None
    batches = ShardedBatches(len(train_ds), t.per_device_train_batch_size, d.rank, d.world_size,
                             t.seed, accum, lengths, t.dataloader_drop_last)
    if len(batches) == 0:
        raise PipelineError(
            f"train split has {len(train_ds)} rows, fewer than one optimizer step needs "
            f"({batches.global_batch * accum}); lower per_device_train_batch_size or "
            "gradient_accumulation_steps"
        )
    loader = make_loader(train_ds, batches, collate_fn, t, d.device)
    return (lambda epoch, start: micro_batches(loader, epoch, start),
            len(batches) // accum, len(batches))
