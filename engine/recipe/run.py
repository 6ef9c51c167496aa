"""The training recipe: one run object that owns every component and one progress record.

`TrainingRun(cfg, paths, dist).fit()` is the whole of training on one rank (torchtitan's
Trainer, torchtune's recipe classes): `setup()` builds the components in a fixed order,
`train_step()` runs one optimizer step, `maybe_log()`, `maybe_evaluate_and_save()` and
`finish()` do the rest. The torchrun worker drives it through `train()`; tests can drive it
in-process.

Loss is token-weighted across micro-batches *and* ranks: each step's summed loss is divided by
the number of target tokens in the whole global batch (counted before the backward passes), so
gradient accumulation and world size do not change the objective (HF's accumulation bug).
The strategy (engine.strategies) decides everything about communication; the loop is the same
for single, DDP, FSDP2 and DiLoCo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from engine.datapath.attention import host_keys
from engine.datapath.data import (
    MODEL_COLUMNS,
    count_targets,
    load_tokenized,
    model_inputs,
    to_device,
)
from engine.datapath.loader import open_train_batches
from engine.datapath.prefetch import Prefetched
from engine.datapath.stream import ExampleSource
from engine.modeling.adapter import make_adapter_config_reproducible, make_model_card_reproducible
from engine.modeling.compile import compile_stats
from engine.kinds import kind_of
from engine.modeling.labels import read_labels
from engine.modeling.model import load_tokenizer
from engine.modeling.runtime import (
    activation_offloading,
    apply_allocator_settings,
    attention_backends,
    autocast_dtype,
    configure_torch,
)
from engine.objective.optim import build_scheduler
from engine.objective.optim_in_backward import OptimizerInBackward
from engine.process.comm import CommMeter
from engine.process.distributed import Dist, node_group, setup, teardown
from engine.process.job import RunPaths
from engine.process.preemption import current as armed_stop_signal
from engine.recipe.model_setup import build_model
from engine.recipe.sft.heldout import lm_metrics
from engine.recipe.sft.in_training import GenerationMetrics
from engine.recipe.trainers import register_trainer, run_class, trainer_class  # noqa: F401
from engine.reporting.callbacks import TrainerControl
from engine.reporting.monitor import Monitor, plan_after_step
from engine.reporting.profiler import StepProfiler
from engine.reporting.progress import Progress
from engine.reporting.readback import Readback
from engine.reporting.reporters import MEASURED_METRICS, Console, build_reporters
from engine.state import fingerprint, trainer_state
from finetune import numerics
from finetune.config import FinetuneConfig
from finetune.config.compat import check_machine
from finetune.errors import PipelineError, warn
from finetune.files import atomic_dir, write_json_atomic

Go = Callable[[], Any]


@dataclass
class LoggedWindow:
    """A logging row whose device values are on their way to the host (engine.reporting.readback):
    what the host knew at its step, and the device values' readback ([loss_sum, targets, tokens]
    summed over ranks, then the gradient norm)."""

    step: int
    epoch: float
    learning_rate: float
    elapsed: float
    steps: int
    comm: float
    readback: Readback
    #: the trainer type's own statistics in the readback, after the gradient norm
    extra: tuple[str, ...] = ()


def follow_log_level(level: str) -> None:
    """transformers' verbosity for logging.log_level: debug shows its info messages, warning
    and error hide more; info leaves transformers at its own default (warning)."""
    if level == "info":
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity({"debug": hf_logging.INFO, "warning": hf_logging.WARNING,
                              "error": hf_logging.ERROR}[level])


def seed_everything(seed: int | None) -> None:
    if seed is None:  # training.seed: null is drawn by the train stage (tasks/train.py)
        raise PipelineError("training.seed is null in the job: the train stage draws the "
                            "run's seed before it launches; a job started another way names one")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def total_steps(cfg: FinetuneConfig, steps_per_epoch: int | None) -> int:
    if cfg.total_steps_hint:
        return cfg.total_steps_hint
    return max(1, math.ceil(cfg.training.num_train_epochs * steps_per_epoch))


def write_final_metrics(paths: RunPaths, result: dict[str, Any]) -> None:
    """The final metrics; with `paths.timings_file`, the machine's measurements
    (MEASURED_METRICS) go there and `metrics_file` keeps what the params and data determine."""
    if paths.timings_file is None:
        write_json_atomic(paths.metrics_file, result)
        return
    timings = {k: v for k, v in result.items() if k in MEASURED_METRICS}
    write_json_atomic(paths.timings_file, timings)
    write_json_atomic(paths.metrics_file, {k: v for k, v in result.items() if k not in timings})


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def train(cfg: FinetuneConfig, paths: RunPaths, go: Go | None = None,
          stream: ExampleSource | None = None) -> dict[str, Any]:
    """Run training on this rank (process group set up and torn down here); the main rank
    writes the trained model and metrics. `go`: called by the main rank before it writes
    anything (the launcher's confirmation); returns the file to stream logged rows to, or None.
    `stream`: the streamed train split (epoch -> examples), else `paths.train_data` is read."""
    apply_allocator_settings(cfg.training)  # before CUDA allocates anything
    d = setup(cfg.distributed, cfg.training.resolved_device, numerics.plan(cfg).threads)
    try:
        with attention_backends(cfg.training, d.device):
            return run_class(cfg)(cfg, paths, d, go, stream).fit()
    finally:
        teardown()


class TrainingRun:
    """Model, strategy, optimizer, scheduler, scaler, monitor, reporters and the progress
    record of one training run on one rank. What other code may use of it is
    engine.state.run_view.RunView; a trainer type (`training.type`) subclasses it and overrides
    its hooks (`columns`, `open_train_data`, `prepare_step`, `count_targets`, `micro_step`, `window_metrics`,
    `evaluate`, `metrics`, and for the evaluate stage `heldout_metrics`)."""

    #: the tokenized split's columns this method reads (the data path selects these)
    columns: tuple[str, ...] = MODEL_COLUMNS

    def __init__(self, cfg: FinetuneConfig, paths: RunPaths, dist: Dist, go: Go | None = None,
                 stream: ExampleSource | None = None):
        self.cfg, self.paths, self.dist = cfg, paths, dist
        self.go, self.stream = go or (lambda: None), stream
        self.amp = autocast_dtype(cfg.training, dist.device)
        self.meter = CommMeter()
        self.progress = Progress(dist.device)
        self.monitor = Monitor.from_config(cfg)
        self.reporters = None
        #: log_on_each_node: another node's local rank 0 prints the rows (stdout only)
        self.node_console: Console | None = None
        self.control = TrainerControl()  # what callbacks ask of the loop
        self.callback_states: dict = {}  # restored from a checkpoint
        self.history: list[dict] = []  # rows restored from a checkpoint
        self._fingerprint: dict[str, Any] | None = None
        self.logged: LoggedWindow | None = None  # a row not yet emitted
        #: a scheduler's signal this process is armed for (engine.process.preemption)
        self.stop_signal = armed_stop_signal()
        #: seconds this process spent in in-training evaluations (the final metrics')
        self.eval_seconds = 0.0

    def log(self, line: str) -> None:
        if self.dist.is_main and self.cfg.logging.log_level in ("debug", "info"):
            print(line, flush=True)

    # -- building ------------------------------------------------------------------------
    def setup(self) -> None:
        """Everything, in the order that fixes the random streams (init, LoRA, data)."""
        t, d = self.cfg.training, self.dist
        follow_log_level(self.cfg.logging.log_level)
        check_machine(self.cfg, d.device)  # what this device cannot run: one line
        configure_torch(t)
        self.node_group = node_group(d) if self.cfg.checkpoint.save_on_each_node else None
        if self.stop_signal:  # collective: its gloo group, when the backend is not gloo
            self.stop_signal.bind(d.world_size)
        if self.cfg.distributed.nnodes > 1:  # training.seed null: node 0's stage drew it
            box = [t.seed]
            torch.distributed.broadcast_object_list(box, src=d.main_rank)
            t.seed = box[0]
        seed_everything(t.seed)
        self.tokenizer = load_tokenizer(self.cfg.model, self.paths.project_root)
        self.labels = read_labels(self.paths.labels)  # a classifier's class names
        self.prepare_model()
        eval_path = self.paths.eval_data
        # the method's columns and the model kind's (a vision-language model's images)
        self.columns = (*type(self).columns, *kind_of(self.cfg).data_columns)
        self.eval_data = (load_tokenized(eval_path, self.columns)
                          if eval_path and eval_path.exists() else None)
        self.warn_against_direction()
        self.generation_metrics = self.build_generation_metrics()
        self.open_batches, self.steps_per_epoch, self.epoch_len = self.open_train_data()
        self.max_steps = total_steps(self.cfg, self.steps_per_epoch)
        self.optimizer = self.strategy.build_optimizer()
        self.in_backward = (OptimizerInBackward(self.strategy.module, self.optimizer)
                            if t.fuse_optim_with_backward else None)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.scheduler, self.max_steps)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp == torch.float16 else None
        self.start, self.history = trainer_state.start(self)
        self.start_step = self.progress.step

    def warn_against_direction(self) -> None:
        """checkpoint.greater_is_better set against metric_for_best_model's own direction is
        kept, as HF keeps it, and said once."""
        ck = self.cfg.checkpoint
        if (ck.metric_for_best_model and ck.greater_is_better is not None
                and self.dist.is_main):
            own = ck.model_copy(update={"greater_is_better": None}).higher_wins
            if own != ck.greater_is_better:
                warn(f"checkpoint.greater_is_better {str(ck.greater_is_better).lower()} ranks "
                     f"{ck.metric_for_best_model} {'higher' if ck.greater_is_better else 'lower'}"
                     f" as better, against its own direction; kept as set (HF semantics)")

    def build_generation_metrics(self) -> GenerationMetrics | None:
        """eval.during_training_metrics: the generation subset, its prompts encoded once (only
        where in-training evaluation runs)."""
        ev = self.cfg.eval
        if not (ev.during_training_metrics and self.paths.formatted is not None
                and self.eval_data is not None and ev.evaluates_in_training):
            return None
        return GenerationMetrics(self.cfg, self.paths.project_root, self.paths.formatted,
                                 self.tokenizer, self.dist, self.labels)

    def prepare_model(self) -> None:
        """The model, its strategy, loss and batch layout (engine.recipe.model_setup's order)."""
        built = build_model(self.cfg, self.paths.project_root, self.dist, self.meter,
                            self.labels, self.tokenizer.pad_token_id, self.amp, self.log)
        self.model, self.strategy, self.loss = built.model, built.strategy, built.loss
        self.collate_fn, self.construction = built.collate_fn, built.construction
        self.eval_collate = built.eval_collate
        self.trainable, self.total = built.trainable, built.total

    def open_train_data(self):
        """(open(epoch, start) -> micro-batches, optimizer steps per epoch, micro-batches per
        epoch): the loader's (engine.datapath.loader). A method that visits each step's batches
        more than once (GRPO's num_iterations) wraps them here, before the step count and the
        scheduler are derived from them."""
        return open_train_batches(self.cfg.training, self.paths.train_data,
                                  self.strategy.data_view(self.dist), self.collate_fn,
                                  self.stream, self.columns)

    def open_reporters(self) -> None:
        """On the main rank, once the launcher confirmed the job: from here on we may write
        (a fresh run moves an earlier run's checkpoints aside just before it first writes
        there: trainer_state.make_room). The other ranks wait
        for the confirmation too, on the file rather than in a collective, so none sits out
        distributed.ddp_timeout while the launcher runs its checks."""
        relay = self.go()
        if not self.dist.is_main:
            log_cfg = self.cfg.logging
            if (log_cfg.log_on_each_node and self.dist.leads_another_node
                    and log_cfg.log_level in ("debug", "info")):
                # the node as the params name it (global ranks follow rendezvous order)
                self.node_console = Console(f"[train node {self.cfg.distributed.node_rank}]")
            return
        # user callbacks are built first: one that cannot be built fails before anything moves
        self.reporters = build_reporters(self.cfg.logging, self.paths.plots_dir,
                                         self.paths.project_root, relay, self.history)
        if self.callback_states and self.cfg.logging.restore_callback_states_from_checkpoint:
            self.reporters.load_state_dicts(self.callback_states)
        per_epoch = f"{self.steps_per_epoch}/epoch" if self.steps_per_epoch else "streamed"
        self.log(f"[train] {self.trainable:,} trainable / {self.total:,} params; "
                 f"{self.max_steps} steps ({per_epoch}); strategy {self.strategy.name}, world "
                 f"size {self.dist.world_size}; start step {self.progress.step}")

    @property
    def writes_checkpoint_meta(self) -> bool:
        """The main rank, and with save_on_each_node each other node's first rank."""
        return self.dist.is_main or (self.node_group is not None
                                     and self.dist.leads_another_node)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this run's trajectory (engine.state.fingerprint); hashed once, on
        demand."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint.of_run(self.cfg, self.paths)
        return self._fingerprint

    @property
    def state(self):
        """The callbacks' view of where training is (with the control they steer through)."""
        return self.progress.view(self.max_steps, self.epoch_len, self.control)

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        self.setup()
        self.open_reporters()
        self.batches = self.prefetched(self.open_batches(self.progress.epoch,
                                                         self.progress.batch_in_epoch))
        self.started, self.first_step_at = time.perf_counter(), None
        self.speed_mark: tuple[float, int, int] | None = None
        self.model.train()
        if self.reporters:
            self.reporters.on_train_begin(self.state)
        self.mark_speed()
        profiler = StepProfiler.from_config(self.cfg.logging, self.paths.project_root,
                                            self.dist.device, self.dist.rank, self.log)
        with profiler or contextlib.nullcontext():
            while self.progress.step < self.max_steps:
                if self.reporters:
                    if self.progress.batch_in_epoch in (0, self.epoch_len):
                        self.reporters.on_epoch_begin(self.state)
                    self.reporters.on_step_begin(self.state)
                grad_norm = self.train_step()
                if profiler:
                    profiler.step(self.progress.step)
                self.mark_speed()
                self.maybe_log(grad_norm)
                if self.maybe_evaluate_and_save():
                    break
        return self.finish()

    def prefetched(self, batches):
        """The micro-batches, collated ahead on a background thread (engine.datapath.prefetch)
        unless DataLoader workers already do that; deep enough for one whole optimizer step."""
        t = self.cfg.training
        if t.dataloader_num_workers > 0:
            return batches
        return Prefetched(batches, depth=t.gradient_accumulation_steps + 1)

    def train_step(self) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches; returns the
        gradient norm (a device tensor: read only when logged)."""
        t, d, progress = self.cfg.training, self.dist, self.progress
        micro = self.prepare_step([progress.consume(next(self.batches))
                                   for _ in range(t.gradient_accumulation_steps)])
        local_targets = sum(self.count_targets(b) for b in micro)
        divisor = self.strategy.loss_divisor(local_targets, progress.step)
        # a device tensor from a collective stays on the device (no host sync per step)
        divisor = (divisor.clamp_min(1e-9) if isinstance(divisor, torch.Tensor)
                   else max(divisor, 1e-9))
        kept = host_keys()  # what the attention kernel reads on the host
        for i, host_batch in enumerate(micro):
            batch = to_device(host_batch, d.device, kept)
            progress.add_loss(self.strategy.forward_backward(
                functools.partial(self.micro_step, host_batch["labels"]), batch, divisor,
                self.amp, last_micro_batch=i == len(micro) - 1))
        grad_norm = self._optimizer_step()
        progress.step_done(local_targets)
        self.first_step_at = self.first_step_at or time.time()
        outer = self.strategy.after_optimizer_step(progress.step)
        if self.reporters:
            self.reporters.on_step_end(self.state)
            if outer:
                self.reporters.on_log(self.state, outer)
        return grad_norm

    def prepare_step(self, micro: list[dict]) -> list[dict]:
        """The step's host micro-batches, before their targets are counted: where a method
        whose targets exist only after work inside the step (generating completions, scoring
        them) builds its batches. SFT's are the loader's, as they are."""
        return micro

    def count_targets(self, host_batch: dict) -> int:
        """What the step's loss is averaged over, counted on the host before any backward:
        target tokens here; a trainer type whose objective is per example (DPO: per pair)
        counts those. Summed over the micro-batches and ranks of a step, it is the divisor."""
        return count_targets(host_batch)

    def window_metrics(self) -> dict[str, torch.Tensor]:
        """A trainer type's own statistics for the logging row, read once per logging step:
        name -> a device tensor summed over the window's micro-batches (then reset). They are
        summed over ranks with the loss and divided by the window's targets (`count_targets`),
        so they are means. SFT logs none."""
        return {}

    def window_means(self, sums: dict[str, float], targets: float) -> dict[str, float]:
        """The logged values of `window_metrics`' sums (the window's, all ranks): their means
        over the window's targets. A method whose statistics have other denominators (KTO's
        means per label) overrides it."""
        return {name: value / max(targets, 1) for name, value in sums.items()}

    def micro_step(self, host_labels: torch.Tensor, batch: dict, divisor) -> torch.Tensor:
        """Forward and backward of one micro-batch on the device; returns its summed loss
        (the objective before dividing by `divisor`, the step's target count). `host_labels`:
        the labels still on the host, where the loss finds its target rows without a device
        sync. The hook a `training.type` subclass overrides for another objective
        (engine/state/run_view.py); the strategy runs it under its gradient-sync context."""
        t, device = self.cfg.training, self.dist.device
        with activation_offloading(t, device):
            with (torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None),
                  self.loss.computing(host_labels)):
                output = self.model(**model_inputs(batch), use_cache=False)
            loss_sum = self.loss.loss_sum(output, batch["labels"])
            loss = loss_sum / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss_sum

    def _optimizer_step(self) -> torch.Tensor:
        if self.in_backward is not None:  # every parameter was updated during backward
            self.scheduler.step()
            return torch.tensor(float("nan"))
        self.strategy.before_optimizer_step(self.progress.step)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.training.max_grad_norm
        grad_norm = self.strategy.clip_grad_norm(float("inf") if max_norm is None else max_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def mark_speed(self) -> None:
        """Where the final speed metrics start counting: the first step after
        training.speed_metrics_start_step (one device sync, once per run)."""
        if self.speed_mark is None and (
                self.progress.step >= self.cfg.training.speed_metrics_start_step):
            if self.dist.device.type == "cuda":
                torch.cuda.synchronize()
            self.speed_mark = (time.perf_counter(), self.progress.real_tokens, self.progress.step)

    def speed_metrics(self) -> dict[str, Any]:
        """Tokens (all ranks) and steps per second since the mark."""
        if self.speed_mark is None:
            return {}
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize()
        started, tokens_before, step_before = self.speed_mark
        elapsed = max(time.perf_counter() - started, 1e-9)
        tokens = torch.tensor(float(self.progress.real_tokens - tokens_before),
                              dtype=torch.float64, device=self.dist.device)
        if self.dist.world_size > 1:  # metrics, not training traffic: not metered
            torch.distributed.all_reduce(tokens)
        tokens = float(tokens) / self.strategy.batch_replicas
        return {"train_tokens_per_second": round(tokens / elapsed, 3),
                "train_steps_per_second": round((self.progress.step - step_before) / elapsed, 4),
                "speed_metrics_start_step": step_before}

    def maybe_log(self, grad_norm: torch.Tensor) -> None:
        """At a logging step: one reduction for the whole window, its values sent to the host
        without a sync (engine.reporting.readback); a row is emitted once its values arrived."""
        self.emit_logged(wait=False)
        step, log_cfg = self.progress.step, self.cfg.logging
        every = log_cfg.logging_steps
        strategy = log_cfg.logging_strategy
        epoch_end = self.progress.at_epoch_end(self.epoch_len)
        periodic = (strategy == "steps" and every and step % every == 0) or (
            strategy == "epoch" and epoch_end)
        if not (periodic or step == self.max_steps
                or (step == 1 and log_cfg.logging_first_step)):
            return
        self.emit_logged(wait=True)  # the last window's row first
        window, d = self.progress.window, self.dist
        extra = self.window_metrics()
        totals = torch.stack([window.loss_sum, *(torch.tensor(
            float(x), dtype=torch.float64, device=d.device) for x in (window.targets,
                                                                       window.tokens)),
                              *(v.to(torch.float64) for v in extra.values())])
        if d.world_size > 1:  # metrics, not training traffic: not metered
            torch.distributed.all_reduce(totals)
        norm = grad_norm.detach().to(totals.device, torch.float64).reshape(1)
        self.logged = LoggedWindow(
            step=step, epoch=self.progress.fractional_epoch(self.epoch_len),
            learning_rate=float(self.scheduler.get_last_lr()[0]),
            elapsed=time.perf_counter() - window.started, steps=window.steps,
            comm=self.meter.take_window(), readback=Readback(torch.cat([totals, norm])),
            extra=tuple(extra))
        self.progress.new_window()
        self.emit_logged(wait=step == self.max_steps)  # off CUDA: at once

    def emit_logged(self, wait: bool) -> None:
        """The pending row to the reporters, if its values arrived (`wait`: wait for them)."""
        logged = self.logged
        if logged is None or not (wait or logged.readback.ready()):
            return
        self.logged = None
        loss_sum, targets, tokens, *extra = logged.readback.values()
        grad_norm = extra.pop(len(logged.extra))
        replicas = self.strategy.batch_replicas  # ranks that counted the same batch
        targets, tokens = targets / replicas, tokens / replicas
        self.progress.tokens_seen += int(tokens)
        if not (self.reporters or self.node_console):
            return
        log_cfg = self.cfg.logging
        logs = {
            "loss": loss_sum / max(targets, 1),
            "learning_rate": logged.learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": tokens / max(logged.elapsed, 1e-9),
            "comm_bytes_per_step": logged.comm / max(logged.steps, 1),
            "epoch": logged.epoch,
            "memory_rss_mb": peak_rss_mb(),
            **self.window_means({name: value / replicas
                                 for name, value in zip(logged.extra, extra)}, targets),
        }
        if log_cfg.include_num_input_tokens_seen:
            logs["num_input_tokens_seen"] = self.progress.tokens_seen
        if self.dist.device.type == "cuda":
            logs["cuda_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        state = dataclasses.replace(self.state, step=logged.step, epoch=logged.epoch)
        for each in filter(None, (self.reporters, self.node_console)):
            each.on_log(state, logs)

    def maybe_evaluate_and_save(self) -> bool:
        """Evaluate and checkpoint when due (the step's StepPlan); True when early stopping or
        a callback ends the run here."""
        step = self.progress.step
        epoch_end = self.progress.at_epoch_end(self.epoch_len)
        last = step == self.max_steps
        if epoch_end and self.reporters:
            self.reporters.on_epoch_end(self.state)
        asked = self.control_requests()
        # the last step just finishes; before it, every rank learns whether any got the signal
        signalled = not last and self.stop_signal is not None and self.stop_signal.agreed()
        plan = plan_after_step(
            self.cfg.checkpoint, self.cfg.eval, step=step, epoch=self.progress.epoch,
            epoch_end=epoch_end, last=last, asked=asked, early_stop=self.monitor.should_stop,
            signalled=signalled,
            can_evaluate=self.eval_data is not None and self.cfg.eval.evaluates_in_training)
        if plan.flush:
            self.emit_logged(wait=True)
        evaluated = self.evaluate() if plan.evaluate else {}
        stop = plan.stops(self.monitor.should_stop)
        path = trainer_state.save(self, evaluated) if plan.saves(stop) else None
        if path is not None and self.reporters:
            self.reporters.on_save(self.state, path)
        if signalled and not stop:  # a stop that ends the run anyway finishes it
            self.stop_on_signal(path, evaluated)
        if stop:
            self.log_stop(step, by_callback=plan.asked_stop)
        return stop

    def log_stop(self, step: int, by_callback: bool) -> None:
        if by_callback:
            self.log(f"[train] stopping at step {step}: a callback set "
                     "control.should_training_stop")
            return
        m = self.monitor
        self.log(f"[train] early stopping at step {step}: {m.metric} has not improved by "
                 f"more than {m.threshold:g} for {m.bad_evals} evaluations (best "
                 f"{m.best:.6g} at step {m.best_step})")

    def stop_on_signal(self, path, evaluated: dict) -> None:
        """The scheduler's signal: a checkpoint at this step (the one due here, else one
        made now, whatever checkpoint.save_strategy says), the stopped file, and every rank
        leaves without the run's end (engine.process.preemption.StoppedBySignal)."""
        if path is None:
            path = trainer_state.save(self, evaluated)
            if self.reporters:
                self.reporters.on_save(self.state, path)
        self.close_batches()
        stopped = self.stop_signal.stopped(self.progress.step, path, self.dist.is_main)
        self.log(str(stopped))
        raise stopped

    def control_requests(self) -> tuple[bool, bool, bool]:
        """(stop, save, evaluate) as the callbacks asked on the main process, the same on
        every rank: one 3-element broadcast per step, only when user callbacks exist."""
        asked = self.control.take() if self.reporters else (False, False, False)
        if self.dist.world_size > 1 and self.cfg.logging.callbacks:
            flags = torch.tensor([float(x) for x in asked], device=self.dist.device)
            torch.distributed.broadcast(flags, src=self.dist.main_rank)
            asked = tuple(bool(x) for x in flags.tolist())
        return asked

    def evaluate(self) -> dict[str, float]:
        """The held-out loss over eval.eval_batches and, with eval.during_training_metrics,
        the generation metrics on their subset (engine.recipe.sft.in_training); logged with
        `eval_seconds`, the time this evaluation took (a measurement of the machine: the
        console, MLflow and the JSON lines have it, the curves and checkpoints do not)."""
        started = time.perf_counter()
        with self.meter.pause():
            ev = self.strategy.evaluate_loss(self.eval_data,
                                             self.cfg.training.per_device_eval_batch_size,
                                             self.tokenizer.pad_token_id,
                                             self.cfg.eval.eval_batches, self.amp,
                                             loss_sum_fn=self.loss and self.loss.eval_loss_sum,
                                             collate_fn=self.eval_collate)
            generated = (self.generation_metrics.measure(self.strategy.module, self.amp)
                         if self.generation_metrics is not None else {})
        evaluated = {"eval_loss": ev["loss"], "eval_perplexity": ev["perplexity"], **generated}
        self.monitor.update(evaluated, self.progress.step)
        seconds = time.perf_counter() - started
        self.eval_seconds += seconds
        if self.reporters:
            self.reporters.on_log(self.state, {"eval_loss": ev["loss"], **generated,
                                               "eval_seconds": round(seconds, 3)})
            self.reporters.on_evaluate(self.state, evaluated)
        return evaluated

    # -- the evaluate stage -----------------------------------------------------------------
    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        """The evaluate stage's numbers for this method (engine.evaluate hands it the models and
        the held-out split as engine.evaluation.heldout.HeldOut, and writes what it returns):
        a language model's loss, perplexity and scored generations (engine.recipe.sft)."""
        return lm_metrics(held, after_loss)

    # -- the end -------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Final metrics, the best checkpoint if asked, the trained model, the reporters' end."""
        self.emit_logged(wait=True)
        runtime = time.perf_counter() - self.started
        self.close_batches()
        result = self.metrics(runtime)
        trainer_state.make_room(self)  # a run that saved no checkpoint: not beside another's
        if self.cfg.checkpoint.load_best_model_at_end:
            result["loaded_best_step"] = trainer_state.load_best(self)
        self.write_trained()
        if self.dist.is_main:
            self.log(f"[train] communication ({self.strategy.name}): "
                     f"{result['comm_bytes_total'] / 1e6:.3f} MB sent per rank, "
                     f"{result['comm_bytes_per_step'] / 1e3:.1f} KB per optimizer step")
            self.reporters.on_train_end(self.state)
            write_final_metrics(self.paths, result)
        if self.dist.world_size > 1:
            torch.distributed.barrier()
        return result

    def close_batches(self) -> None:
        if isinstance(self.batches, Prefetched):
            self.batches.close()
        del self.batches  # stops the loader's workers

    def metrics(self, runtime: float) -> dict[str, Any]:
        progress, cfg = self.progress, self.cfg
        rows = trainer_state.history_rows(self.reporters)
        result = {
            # the last training row (an eval row may come after it at the final step)
            "train_loss": next((r["loss"] for r in reversed(rows) if "loss" in r), None),
            "global_step": progress.step,
            "epoch": progress.fractional_epoch(self.epoch_len),
            **({"num_input_tokens_seen": progress.tokens_seen}
               if cfg.logging.include_num_input_tokens_seen else {}),
            "train_runtime": round(runtime, 3),
            "eval_seconds": round(self.eval_seconds, 3),  # this process's evaluations
            "first_step_unix": self.first_step_at,  # benchmarks: launch to first step
            "trainable_params": self.trainable,
            "total_params": self.total,
            "world_size": self.dist.world_size,
            "strategy": self.strategy.name,
            "seed": cfg.training.seed,  # the one drawn when the params say null
            **self.construction,  # construct_model_on meta: what the main rank read
            **progress.fill_metrics(),
            **self.speed_metrics(),
            **(compile_stats() if cfg.training.torch_compile else {}),
            "memory_rss_mb": peak_rss_mb(),
            **({"cuda_max_memory_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}
               if self.dist.device.type == "cuda" else {}),
            # this process's steps (a resumed run starts later)
            **self.meter.summary(progress.step - self.start_step),
        }
        if self.monitor.best is not None:
            result.update({f"best_{self.monitor.metric}": self.monitor.best,
                           "best_step": self.monitor.best_step})
        return result

    def write_trained(self) -> None:
        """The main rank writes a normal HF/PEFT folder; FSDP2 first gathers the full
        weights (a collective on every rank)."""
        full = self.strategy.full_state_dict()
        if not self.dist.is_main:
            return
        module = self.strategy.module
        make_adapter_config_reproducible(module, self.cfg.model)
        with atomic_dir(self.paths.trained) as staging:
            self.strategy.save_pretrained(staging, full)
            make_model_card_reproducible(staging, self.cfg.model, self.paths.project_root)
            self.carry_chat_template()
            kind = kind_of(self.cfg)
            kind.save_beside_weights(staging, kind.processor(
                self.tokenizer, self.cfg.model, self.paths.project_root), self.labels)


    def carry_chat_template(self) -> None:
        """A chat dataset's template (data.chat_template) goes into the saved tokenizer: the
        exported model formats conversations as it was trained to, and the evaluate stage's
        harness (apply_chat_template) uses it."""
        root = self.paths.project_root
        for _, part in self.cfg.data.parts():
            template = part.datatype.serving_chat_template(self.tokenizer, root)
            if template:
                self.tokenizer.chat_template = template
                return


register_trainer("sft", TrainingRun)
