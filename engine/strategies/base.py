"""The strategy interface, and `single` (one process, no communication) as its base.

torchtitan's split: the model is built plainly, a strategy parallelises it. The loop only calls
the methods below, so DDP, FSDP2 and DiLoCo differ in these small classes and nowhere else:
how the model is wrapped, which gradients or parameters are communicated and when, how the loss
is normalised across ranks, and what goes into a (DCP) checkpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from engine.datapath.data import token_loss_sum
from engine.evaluation.heldout import evaluate_loss
from engine.modeling.adapter import save_adapter
from engine.modeling.construction import materialise
from engine.modeling.model import DTYPES
from engine.objective.optim import build_optimizer
from engine.process.comm import CommMeter, all_reduce_count
from engine.process.distributed import Dist
from finetune.config import FinetuneConfig
from finetune.config.distributed import DistributedConfig
from finetune.config.optim import OptimizerConfig
from finetune.config.training import TrainingConfig


@dataclass(frozen=True)
class StrategySetup:
    """What a strategy is given of the config, and nothing more: the `distributed` section (each
    strategy reads its own part of it: the DDP knobs, `fsdp`, `diloco`, `pipeline`), the
    optimizer it builds over its module's parameters, and the few values a strategy applies
    itself (the pipeline compiles its stages and computes the loss; FSDP2 gathers only an
    adapter's weights for export)."""

    distributed: DistributedConfig
    optimizer: OptimizerConfig
    training: TrainingConfig  # compile options and loss_chunk_tokens (the pipeline's stages)
    max_seq_length: int  # the pipeline's fixed stage shapes
    trains_adapter: bool  # peft.use_peft

    @classmethod
    def of(cls, cfg: FinetuneConfig) -> "StrategySetup":
        return cls(distributed=cfg.distributed, optimizer=cfg.optimizer, training=cfg.training,
                   max_seq_length=cfg.data.max_seq_length, trains_adapter=cfg.peft.use_peft)


T = TypeVar("T")


@dataclass(frozen=True)
class StoredWeights:
    """The checkpoint a model built on meta (training.construct_model_on: meta) reads its
    weights from: a local folder or a hub id (engine.modeling.model.resolve_model_ref's), at
    a hub revision."""

    ref: str
    revision: str | None


class Placement:
    """This rank's part of the model as `Strategy.place` left it, with its weights: on the
    device, or read from the checkpoint onto it. A strategy that shards before any weight
    exists returns a placement that reads after the wrap instead (fsdp2.ShardedRead), so model
    setup runs one order for both: place, ..., `when_weights_exist(probes)`, the strategy's
    wrap, `after_wrap()`."""

    def __init__(self, model: torch.nn.Module, construction: dict | None = None):
        self.model = model
        self.construction = construction or {}  # what was read from the checkpoint (meta)

    def when_weights_exist(self, fn: Callable[[], T]) -> Callable[[], T]:
        """Run `fn` (what needs real weights: the batch-layout and loss probes) as soon as
        this rank's weights exist: here at once, before the wrap. Returns what gives fn's
        result (valid after `after_wrap`)."""
        result = fn()
        return lambda: result

    def after_wrap(self) -> dict:
        """Called once the strategy has wrapped the model; returns what was read from the
        checkpoint ({} when the model was loaded with its weights)."""
        return self.construction


class Strategy:
    name = "single"
    #: every rank must run the same number of forwards in eval (FSDP2 gathers inside forward)
    eval_lockstep = False

    @property
    def batch_replicas(self) -> int:
        """How many ranks hold each batch (metrics divide summed counts by it)."""
        return 1

    def data_view(self, d: Dist) -> Dist:
        """The ranks as the data loader sees them (which shard this rank reads)."""
        return d

    def generation_done(self, finished: torch.Tensor) -> bool:
        """Whether a generation loop may stop, given which of this rank's rows finished
        (GRPO's rollout): here, when all of them did."""
        return bool(finished.all())

    def shares_prompt_forward(self) -> bool:
        """Whether a micro-batch may run as two forwards before its one backward: the prefix
        its rows share once (with a KV cache), then each row's rest against it (GRPO's
        completions of one prompt: engine.recipe.grpo.loss.completion_logits). Yes here: one
        process runs the whole, unwrapped model. The other strategies keep one forward per
        micro-batch: each wraps or splits the model (DDP's gradient hooks, FSDP2's gathers
        inside each forward, the pipeline's schedule, DiLoCo's inner strategy), and the
        shared forward was measured and tested on one process only."""
        return True

    def __init__(self, setup: StrategySetup, d: Dist, meter: CommMeter):
        self.setup, self.d, self.meter = setup, d, meter
        self.model: torch.nn.Module | None = None  # what the loop calls forward on

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2's mixed precision computes parameters in (`fsdp.param_dtype`), None
        without one. The bf16 CPU kernels are chosen by it before the wrap applies it. Read
        from the config wherever it admits an `fsdp` section (fsdp2, sharded DiLoCo), so
        strategy fsdp2 at world size 1, which runs as this class, chooses them as it always
        did."""
        c = self.setup.distributed.fsdp
        return DTYPES.get(c.param_dtype) if c is not None else None

    # -- model and optimizer -------------------------------------------------------------
    def keep_own_part(self, model: torch.nn.Module) -> torch.nn.Module:
        """Drop what this rank never runs, before the model is placed on the device (or read
        from the checkpoint, construct_model_on meta); every rank runs all of it here."""
        return model

    def place(self, model: torch.nn.Module, stored: StoredWeights | None) -> Placement:
        """Put this rank's part (after `keep_own_part`, adapters attached) where it trains,
        before the wrap: moved to the device, or, built on meta (`stored`), its placeholders
        read from the checkpoint straight onto the device. A strategy that shards overrides
        it to read only its shards after the wrap."""
        if stored is None:
            return Placement(model.to(self.d.device))
        return Placement(model, materialise(model, stored.ref, stored.revision, self.d.device))

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.model = model
        return model

    @property
    def module(self) -> torch.nn.Module:
        """The model without a communication wrapper: state dicts, eval, export use it."""
        return self.model

    def build_optimizer(self) -> torch.optim.Optimizer:
        log = (lambda line: print(line, flush=True)) if (
            self.d.is_main and self.setup.optimizer.log_param_groups) else None
        return build_optimizer(self.module.named_parameters(), self.setup.optimizer, log,
                               model=self.module)

    def trainable_names(self) -> set[str]:
        return {n for n, p in self.module.named_parameters() if p.requires_grad}

    # -- one optimizer step --------------------------------------------------------------
    def loss_divisor(self, local_targets: int, step: int) -> float | torch.Tensor:
        """What a micro-batch's summed loss is divided by. Gradient-averaging strategies use
        global targets / world size, so the averaged gradient is the global token mean. With
        several ranks it is a device tensor (the all-reduced count, never read on the host:
        no sync per step)."""
        if self.d.world_size == 1:
            return float(local_targets)
        total = all_reduce_count(local_targets, self.meter, "loss_normaliser", self.d.device,
                                 on_device=True)
        return (total / self.d.world_size).float()  # the loss's dtype, as a Python float was

    def sync_context(self, last_micro_batch: bool):
        """Gradient sync only on the last micro-batch of an accumulation."""
        return contextlib.nullcontext()

    def make_loss(self, build: Callable[[], object]):
        """The loss the run's micro-batch step computes on the model's output: `build()`
        (the chunked, full or a user's loss). None where forward_backward computes its own
        (a pipeline's last stage)."""
        return build()

    def forward_backward(self, step: Callable[[dict, float], torch.Tensor], batch: dict,
                         divisor: float | torch.Tensor, amp, last_micro_batch: bool) -> torch.Tensor:
        """One micro-batch's forward and backward; returns its summed loss. Here: the run's
        own step (model, loss, scaler) under this strategy's gradient-sync context. A
        strategy that runs a schedule of its own (the pipeline) overrides it."""
        with self.sync_context(last_micro_batch=last_micro_batch):
            return step(batch, divisor)

    def before_optimizer_step(self, step: int) -> None:
        """Hook for strategies that sync gradients by hand."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def after_optimizer_step(self, step: int) -> dict[str, float]:
        """Hook after `step` optimizer steps (DiLoCo's outer sync); returns metrics to log."""
        return {}

    def evaluate_loss(self, dataset, batch_size: int, pad_id: int, max_batches: int | None,
                      amp, loss_sum_fn=token_loss_sum, collate_fn=None) -> dict:
        """The in-training evaluation's loss over `dataset` (all ranks); `collate_fn` builds
        the batches (None: dynamic padding)."""
        return evaluate_loss(self.module, dataset, batch_size, pad_id, self.d, max_batches, amp,
                             lockstep=self.eval_lockstep, loss_sum_fn=loss_sum_fn,
                             collate_fn=collate_fn)

    # -- checkpoint and export -----------------------------------------------------------
    def dcp_state(self, optimizer) -> dict:
        """What DCP saves/loads: trainable weights and optimizer state, FQN-keyed (so a
        checkpoint does not depend on wrappers), sharded where the model is."""
        model_sd, optim_sd = get_state_dict(self.module, optimizer)
        names = self.trainable_names()
        return {"model": {k: v for k, v in model_sd.items() if k in names}, "optim": optim_sd}

    def load_dcp_state(self, optimizer, state: dict) -> None:
        set_state_dict(self.module, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=False))

    def trainer_state(self) -> dict:
        """Small replicated state that is not a tensor tree (e.g. an outer LR schedule)."""
        return {}

    def load_trainer_state(self, state: dict) -> None:
        pass

    def save_pretrained(self, folder, full: dict | None) -> None:
        """The main rank writes the trained model: a normal HF/PEFT folder (a PiSSA/OLoRA
        adapter converted to apply to the original base: save_adapter)."""
        save_adapter(self.module, folder, full)

    def full_state_dict(self) -> dict | None:
        """Collective: the unsharded state dict for export, or None when module.state_dict()
        already is one."""
        return None
