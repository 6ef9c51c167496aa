"""Where a training run is: the one record the loop, checkpoints and callbacks read.

The persisted part (step, epoch, micro-batch position, tokens seen; with it the checkpoint
records the global sample count of the epoch) is what exact resume restores. The rest is this
process's running counters: the current logging window (loss kept on the device until a
logging step, so no host sync per step) and how full the batches were (padding, packing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.reporting.callbacks import TrainState
from finetune.errors import PipelineError

POSITION = ("step", "epoch", "batch_in_epoch", "tokens_seen")


@dataclass
class Window:
    """What happened since the last logging step on this rank."""

    loss_sum: torch.Tensor
    targets: int = 0
    tokens: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Progress:
    device: torch.device = torch.device("cpu")
    step: int = 0
    epoch: int = 0
    #: micro-batches of `epoch` consumed (not just prefetched)
    batch_in_epoch: int = 0
    #: input tokens of all ranks, counted at logging steps
    tokens_seen: int = 0
    #: this rank's real tokens vs token slots computed, examples vs rows
    real_tokens: int = 0
    token_slots: int = 0
    examples: int = 0
    rows: int = 0
    window: Window = field(init=False)

    def __post_init__(self) -> None:
        self.new_window()

    # -- persisted position --------------------------------------------------------------
    def position(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in POSITION}

    def restore(self, meta: dict, micro_batch_samples: int | None = None) -> None:
        """The checkpoint's position. `micro_batch_samples`: examples per micro-batch index on
        all ranks together in this run; when the checkpoint's differed (another world size or
        micro-batch), the position within the epoch comes from its global sample count, so the
        run continues with the first example the checkpointed run had not seen (the order is
        global: engine.datapath.data.ShardedBatches)."""
        for key in POSITION:
            setattr(self, key, int(meta[key]))
        samples = meta.get("samples_in_epoch")
        if micro_batch_samples is None or samples is None:
            return
        if samples != self.batch_in_epoch * micro_batch_samples:
            if samples % micro_batch_samples:
                raise PipelineError(
                    f"checkpoint position: {samples} examples of epoch {self.epoch} seen, not a "
                    f"multiple of this run's {micro_batch_samples} per micro-batch "
                    "(per_device_train_batch_size x world size); keep the global batch size")
            self.batch_in_epoch = samples // micro_batch_samples

    # -- counting ------------------------------------------------------------------------
    def consume(self, batch: dict) -> dict:
        """Take the loader's bookkeeping keys off a micro-batch and count it."""
        epoch, index = batch.pop("key").tolist()
        self.epoch, self.batch_in_epoch = epoch, index + 1
        real, examples = int(batch.pop("real_tokens")), int(batch.pop("examples"))
        self.window.tokens += real
        self.real_tokens += real
        self.token_slots += batch["input_ids"].numel()
        self.examples += examples
        self.rows += batch["input_ids"].shape[0]
        return batch

    def add_loss(self, loss_sum: torch.Tensor) -> None:
        self.window.loss_sum += loss_sum.detach().double()

    def step_done(self, targets: int) -> None:
        self.step += 1
        self.window.targets += targets
        self.window.steps += 1

    def new_window(self) -> None:
        self.window = Window(torch.zeros((), dtype=torch.float64, device=self.device))

    # -- views ---------------------------------------------------------------------------
    def at_epoch_end(self, epoch_len: float) -> bool:
        """The last micro-batch of the epoch was consumed (never for a stream: inf)."""
        return self.batch_in_epoch >= epoch_len

    def fractional_epoch(self, epoch_len: float) -> float:
        return round(self.epoch + self.batch_in_epoch / max(epoch_len, 1), 4)

    def view(self, max_steps: int, epoch_len: float, control=None) -> TrainState:
        """The callbacks' view (read-only but for `control`, their requests to the loop)."""
        return TrainState(step=self.step, max_steps=max_steps,
                          epoch=self.fractional_epoch(epoch_len),
                          num_input_tokens_seen=self.tokens_seen, control=control)

    def fill_metrics(self) -> dict[str, float]:
        return {"padding_fraction": round(1 - self.real_tokens / max(self.token_slots, 1), 4),
                "examples_per_row": round(self.examples / max(self.rows, 1), 4)}
