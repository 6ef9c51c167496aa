"""What code outside the run object may read and call on it: the run's declared surface.

`engine.state.trainer_state` (what a checkpoint holds, and the resume) takes a `RunView`, not a
TrainingRun, so the surface it depends on is written down and checked
(tests/test_layering.py: every `run.X` it reads is declared here, and TrainingRun provides
every member). A `training.type` subclass of engine.recipe.run.TrainingRun keeps this surface and
overrides the run's documented hooks (`columns`: the split columns it reads;
`open_train_data`: the micro-batches, which it may wrap (revisit a step's); `prepare_step`:
the step's batches before their targets are counted; `micro_step`: one micro-batch's forward
and backward; `count_targets`: what a step's loss is averaged over; `window_metrics`: its own
logged statistics, and `window_means` how they are averaged; `evaluate`; `metrics`;
`heldout_metrics` for the evaluate stage), so
checkpoints, resume, the strategies and the reporters work for it unchanged (engine.recipe.dpo
is one). Callbacks see less: `state` (engine.reporting.progress's view and the control object).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from engine.process.distributed import Dist
    from engine.process.job import RunPaths
    from engine.reporting.callbacks import CallbackList
    from engine.reporting.monitor import Monitor
    from engine.reporting.progress import Progress
    from engine.strategies.base import Strategy
    from finetune.config import FinetuneConfig


class RunView(Protocol):
    """The members of a training run that trainer_state (and a trainer type) may use."""

    cfg: FinetuneConfig
    paths: RunPaths
    dist: Dist
    progress: Progress  # step, epoch, data position, loss sums: the one progress record
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Any  # a torch LR scheduler
    scaler: torch.amp.GradScaler | None  # fp16 only
    monitor: Monitor  # best metric, early stopping
    reporters: CallbackList | None  # None off the main rank
    callback_states: dict  # the callbacks' state dicts, restored from a checkpoint
    start: Any  # engine.state.trainer_state.Start: where this run starts (a checkpoint, or fresh)
    node_group: Any  # save_on_each_node: the node-local process group, else None

    #: the tokenized split's columns the method reads (the data path selects only these)
    columns: tuple[str, ...]

    def prepare_step(self, micro: list[dict]) -> list[dict]:
        """The step's host micro-batches before their targets are counted: a method that
        generates or scores inside the step builds its batches here. No-op by default."""
        return micro

    def open_train_data(self) -> tuple[Any, int | None, float]:
        """(open(epoch, start) -> micro-batches, steps per epoch, micro-batches per epoch):
        the loader's by default; a method may wrap them (GRPO repeats a step's prompts)."""

    def log(self, line: str) -> None:
        """One line on the main rank's stdout (at log_level debug or info)."""

    @property
    def writes_checkpoint_meta(self) -> bool:
        """Whether this rank writes a checkpoint's meta record (main, or a node's first)."""

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this run's trajectory (engine.state.fingerprint)."""

