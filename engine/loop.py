"""The training recipe: one readable loop; components come from the engine modules.

Loss is token-weighted across micro-batches *and* ranks: each step's summed loss is divided by
the number of target tokens in the whole global batch (counted before the backward passes), so
gradient accumulation and world size do not change the objective (HF's accumulation bug).
The strategy (engine.strategies) decides everything about communication; the loop is the same
for single, DDP, FSDP2 and DiLoCo.
"""

from __future__ import annotations

import functools
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from engine.callbacks import TrainState
from engine.comm import CommMeter
from engine.data import (ShardedBatches, collate, collate_flat, collate_packed, count_targets,
                         load_tokenized, model_inputs, to_device, token_loss_sum)
from engine.loader import make_loader, micro_batches
from engine.stream import ExampleSource, StreamedBatches
from engine.distributed import Dist, setup, teardown
from engine.evaluation import evaluate_loss
from engine.model import (apply_peft, count_parameters, load_base_model, load_tokenizer,
                          make_adapter_config_reproducible)
from engine.monitor import Monitor, due
from engine.optim import build_scheduler
from engine.runtime import (autocast_dtype, compile_stats, configure_torch,
                            enable_gradient_checkpointing, maybe_compile,
                            use_fast_bf16_cpu_kernels)
from engine.packing import POSITION_IDS, enable_padding_free, probe_packing
from engine.reporters import build_reporters
from engine.strategies import Strategy, build_strategy
from engine.trainer_state import Position, history_rows, load_best, resume, save
from finetune.config import FinetuneConfig
from finetune.errors import PipelineError
from finetune.workspace import Layout, atomic_dir, write_json_atomic


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def total_steps(cfg: FinetuneConfig, steps_per_epoch: int) -> int:
    if cfg.total_steps_hint:
        return cfg.total_steps_hint
    return max(1, math.ceil(cfg.training.num_train_epochs * steps_per_epoch))


def train(cfg: FinetuneConfig, root: Path,
          go: Callable[[], Path | None] | None = None,
          stream: ExampleSource | None = None) -> dict[str, Any]:
    """Run training on this rank; rank 0 writes the trained model and metrics. `go`: called
    by rank 0 before it writes anything (the launcher's confirmation); returns the file to
    stream logged rows to (the launcher forwards them to MLflow), or None. `stream`: the streamed train split (epoch -> examples);
    None reads `data/tokenized/train`."""
    d = setup(cfg.distributed)
    try:
        return _train(cfg, root, d, go or (lambda: None), stream)
    finally:
        teardown()


def _train(cfg, root: Path, d: Dist, go, stream):
    layout = Layout(root)
    t = cfg.training
    amp = autocast_dtype(t, d.device)
    configure_torch(t)
    seed_everything(t.seed)
    tok = load_tokenizer(cfg.model, root)
    base = load_base_model(cfg.model, root)
    enable_gradient_checkpointing(base, t)
    model = apply_peft(base, cfg.peft).to(d.device)
    trainable, total = count_parameters(model)
    fast_linears = use_fast_bf16_cpu_kernels(model, d.device, amp, cfg.distributed)
    if fast_linears and d.is_main:
        print(f"[train] bf16 on CPU: {fast_linears} linear layers use layout-aware GEMMs",
              flush=True)
    collate_fn = _collate_fn(cfg, model, tok, d, amp)
    meter = CommMeter()
    strategy = build_strategy(cfg, d, meter)
    model = maybe_compile(strategy.wrap(model), t)
    eval_ds = None
    if (layout.tokenized / "test").exists():
        eval_ds = load_tokenized(layout.tokenized / "test")
    accum = t.gradient_accumulation_steps
    open_batches, steps_per_epoch, epoch_len = _train_batches(cfg, layout, d, collate_fn, stream)
    n_steps = total_steps(cfg, steps_per_epoch)
    optimizer = strategy.build_optimizer()
    scheduler = build_scheduler(optimizer, cfg.scheduler, n_steps)
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    pos, history = Position(), []
    monitor = Monitor.from_config(cfg)
    if cfg.checkpoint.resume_from_checkpoint:
        pos, history = resume(layout.checkpoints, strategy, optimizer, scheduler, scaler, d,
                               monitor)
    reporters = None
    if d.is_main:
        relay = go()  # the launcher's checks passed: from here on we may write
        reporters = build_reporters(cfg.logging, layout.plots, root, relay, history)
    state = TrainState(step=pos.step, max_steps=n_steps)
    if d.is_main:
        per_epoch = f"{steps_per_epoch}/epoch" if steps_per_epoch else "streamed"
        print(f"[train] {trainable:,} trainable / {total:,} params; {n_steps} steps "
              f"({per_epoch}); strategy {strategy.name}, world size {d.world_size}; "
              f"start step {pos.step}", flush=True)

    start_step = pos.step
    batches = open_batches(pos.epoch, pos.batch_in_epoch)
    # The loss stays a device tensor until a logging step: no host sync per step.
    window = _new_window(d)
    # this rank's real tokens vs token slots computed (padding), examples vs rows (packing)
    fill = {"real": 0, "slots": 0, "examples": 0, "rows": 0}
    started, first_step_at = time.perf_counter(), None
    model.train()
    if reporters:
        reporters.on_train_begin(_sync(state, pos, epoch_len))
    while pos.step < n_steps:
        micro = []
        for _ in range(accum):
            batch = next(batches)
            epoch, index = batch.pop("key").tolist()
            pos.epoch, pos.batch_in_epoch = epoch, index + 1  # consumed, not just prefetched
            real, examples = int(batch.pop("real_tokens")), int(batch.pop("examples"))
            window["tokens"] += real
            micro.append(batch)
            fill["real"] += real
            fill["slots"] += batch["input_ids"].numel()
            fill["examples"] += examples
            fill["rows"] += batch["input_ids"].shape[0]
        local_targets = sum(count_targets(b) for b in micro)
        divisor = strategy.loss_divisor(local_targets, pos.step)
        for i, batch in enumerate(micro):
            batch = to_device(batch, d.device)
            with strategy.sync_context(last_micro_batch=i == accum - 1):
                with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                    logits = model(**model_inputs(batch), use_cache=False).logits
                loss_sum = token_loss_sum(logits, batch["labels"])
                loss = loss_sum / max(divisor, 1e-9)
                (scaler.scale(loss) if scaler else loss).backward()
            window["loss_sum"] += loss_sum.detach().double()
        strategy.before_optimizer_step(pos.step)
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = strategy.clip_grad_norm(t.max_grad_norm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        pos.step += 1
        first_step_at = first_step_at or time.time()
        window["targets"] += local_targets
        window["steps"] += 1
        outer = strategy.after_optimizer_step(pos.step)
        if reporters:
            reporters.on_step_end(_sync(state, pos, epoch_len))
            if outer:
                reporters.on_log(state, outer)

        if pos.step % cfg.logging.logging_steps == 0 or pos.step == n_steps or (
            pos.step == 1 and cfg.logging.logging_first_step
        ):
            _log_window(window, pos, d, reporters, scheduler, grad_norm, state, epoch_len,
                        meter, cfg.logging.include_num_input_tokens_seen)
        epoch_end, last = pos.batch_in_epoch >= epoch_len, pos.step == n_steps
        c = cfg.checkpoint
        save_now = due(c.save_strategy, c.save_steps, pos.step, epoch_end, last)
        evaluated = {}
        if eval_ds is not None and (
            due(cfg.eval.eval_strategy, cfg.eval.eval_steps, pos.step, epoch_end, last)
            or (save_now and cfg.eval.eval_on_save)
        ):
            with meter.pause():
                ev = evaluate_loss(strategy.module, eval_ds, t.per_device_eval_batch_size,
                                   tok.pad_token_id, d, cfg.eval.eval_batches, amp,
                                   lockstep=strategy.eval_lockstep)
            evaluated = {"eval_loss": ev["loss"], "eval_perplexity": ev["perplexity"]}
            monitor.update(evaluated, pos.step)
            if reporters:
                reporters.on_log(state, {"eval_loss": ev["loss"]})
                reporters.on_evaluate(state, evaluated)
        stop = monitor.should_stop and not last
        if save_now or (stop and c.save_strategy != "no"):
            path = save(layout.checkpoints, cfg, strategy, optimizer, scheduler, scaler, pos,
                         d, reporters, monitor, evaluated)
            if reporters:
                reporters.on_save(state, path)
        if stop:
            if d.is_main:
                print(f"[train] early stopping at step {pos.step}: {monitor.metric} has not "
                      f"improved by more than {monitor.threshold:g} for {monitor.bad_evals} "
                      f"evaluations (best {monitor.best:.6g} at step {monitor.best_step})",
                      flush=True)
            break

    runtime = time.perf_counter() - started
    del batches  # stops the loader's workers
    comm = meter.summary(pos.step - start_step)  # this process's steps (resume starts later)
    result = {
        # the last training row (an eval row may come after it at the final step)
        "train_loss": next((r["loss"] for r in reversed(history_rows(reporters)) if "loss" in r), None)
        if reporters else None,
        "global_step": pos.step,
        "epoch": _sync(state, pos, epoch_len).epoch,
        **({"num_input_tokens_seen": pos.tokens_seen}
           if cfg.logging.include_num_input_tokens_seen else {}),
        "train_runtime": round(runtime, 3),
        "first_step_unix": first_step_at,  # benchmarks: launch to first step
        "trainable_params": trainable,
        "total_params": total,
        "world_size": d.world_size,
        "strategy": strategy.name,
        "padding_fraction": round(1 - fill["real"] / max(fill["slots"], 1), 4),
        "examples_per_row": round(fill["examples"] / max(fill["rows"], 1), 4),
        **(compile_stats() if t.torch_compile else {}),
        **comm,
    }
    if monitor.best is not None:
        result.update({f"best_{monitor.metric}": monitor.best, "best_step": monitor.best_step})
    if cfg.checkpoint.load_best_model_at_end:
        result["loaded_best_step"] = load_best(layout.checkpoints, strategy, optimizer, monitor, d)
    _write_trained(layout, cfg, strategy, tok, d)
    if d.is_main:
        print(f"[train] communication ({strategy.name}): {comm['comm_bytes_total'] / 1e6:.3f} MB "
              f"sent per rank, {comm['comm_bytes_per_step'] / 1e3:.1f} KB per optimizer step",
              flush=True)
        reporters.on_train_end(state)
        write_json_atomic(layout.metrics / "train.json", result)
    if d.world_size > 1:
        torch.distributed.barrier()
    return result


def _train_batches(cfg: FinetuneConfig, layout: Layout, d: Dist, collate_fn,
                   stream: ExampleSource | None):
    """(open(epoch, start) -> micro-batches, optimizer steps per epoch, micro-batches per
    epoch); a stream's epoch length is unknown (None, inf)."""
    t = cfg.training
    if stream is not None:
        streamed = StreamedBatches(stream, t.per_device_train_batch_size, d.rank, d.world_size,
                                   collate_fn)
        return streamed.micro_batches, None, math.inf
    train_ds = load_tokenized(layout.tokenized / "train")
    accum = t.gradient_accumulation_steps
    lengths = tuple(len(x) for x in train_ds["input_ids"]) if t.group_by_length else None
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


def _collate_fn(cfg: FinetuneConfig, model, tok, d: Dist, amp):
    """Padded batches, one padding-free row, or packed rows fed the way the probe found this
    model needs."""
    pad = tok.pad_token_id
    if cfg.training.padding_free:
        enable_padding_free(model, model.config.vocab_size, d.device)
        if d.is_main:
            print("[train] padding-free: each micro-batch is one row, attention per example",
                  flush=True)
        return functools.partial(collate_flat, pad_id=pad)
    if not cfg.training.packing:
        return functools.partial(collate, pad_id=pad)
    mask_dtype = amp or next(model.parameters()).dtype
    mode = probe_packing(model, model.config.vocab_size, d.device, mask_dtype)
    capacity = cfg.training.packed_sequence_length or cfg.data.max_seq_length
    if d.is_main:
        print(f"[train] packing: rows of up to {capacity} tokens, examples kept apart by "
              f"{'restarted position_ids' if mode == POSITION_IDS else 'a block mask'}",
              flush=True)
    return functools.partial(collate_packed, pad_id=pad, capacity=capacity,
                             block_mask=None if mode == POSITION_IDS else mask_dtype)


def _write_trained(layout: Layout, cfg, strategy: Strategy, tok, d: Dist) -> None:
    """Rank 0 writes a normal HF/PEFT folder; FSDP2 first gathers the full weights."""
    full = strategy.full_state_dict()  # collective on every rank
    if not d.is_main:
        return
    module = strategy.module
    make_adapter_config_reproducible(module, cfg.model)
    with atomic_dir(layout.trained) as staging:
        if full is None:
            module.save_pretrained(staging, safe_serialization=True)
        else:
            module.save_pretrained(staging, state_dict=full, safe_serialization=True)
        tok.save_pretrained(staging)


def _new_window(d: Dist) -> dict:
    return {"loss_sum": torch.zeros((), dtype=torch.float64, device=d.device), "targets": 0,
            "tokens": 0, "steps": 0, "t0": time.perf_counter()}


def _sync(state: TrainState, pos: Position, epoch_len: int) -> TrainState:
    """The callbacks' view of where training is."""
    state.step = pos.step
    state.epoch = round(pos.epoch + pos.batch_in_epoch / max(epoch_len, 1), 4)
    state.num_input_tokens_seen = pos.tokens_seen
    return state


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def _log_window(window, pos, d, reporters, scheduler, grad_norm, state, epoch_len,
                meter: CommMeter, with_tokens: bool) -> None:
    # One (uncounted: metrics, not training traffic) reduction for the whole window.
    totals = torch.stack([window["loss_sum"].to(torch.float64),
                          torch.tensor(float(window["targets"]), dtype=torch.float64,
                                       device=d.device),
                          torch.tensor(float(window["tokens"]), dtype=torch.float64,
                                       device=d.device)])
    if d.world_size > 1:
        torch.distributed.all_reduce(totals)
    loss_sum, targets, tokens = totals.tolist()
    pos.tokens_seen += int(tokens)
    elapsed = time.perf_counter() - window["t0"]
    comm = meter.take_window()
    if reporters:
        logs = {
            "loss": loss_sum / max(targets, 1),
            "learning_rate": float(scheduler.get_last_lr()[0]),
            "grad_norm": float(grad_norm),
            "tokens_per_second": tokens / max(elapsed, 1e-9),
            "comm_bytes_per_step": comm / max(window["steps"], 1),
            "epoch": _sync(state, pos, epoch_len).epoch,
            "memory_rss_mb": peak_rss_mb(),
        }
        if with_tokens:
            logs["num_input_tokens_seen"] = pos.tokens_seen
        if d.device.type == "cuda":
            logs["cuda_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        reporters.on_log(state, logs)
    window.update(_new_window(d))


