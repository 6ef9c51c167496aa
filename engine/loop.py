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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import checkpoint as ckpt
from engine.comm import CommMeter
from engine.data import (ShardedBatches, collate, collate_packed, count_targets, load_tokenized,
                         model_inputs, take_rows, token_loss_sum)
from engine.distributed import Dist, setup, teardown
from engine.evaluation import evaluate_loss
from engine.model import (apply_peft, count_parameters, load_base_model, load_tokenizer,
                          make_adapter_config_reproducible)
from engine.monitor import Monitor, due
from engine.optim import build_scheduler
from engine.runtime import (compile_stats, configure_torch, enable_gradient_checkpointing,
                            maybe_compile)
from engine.packing import POSITION_IDS, probe_packing
from engine.sinks import MetricSinks
from engine.strategies import Strategy, build_strategy
from finetune.config import FinetuneConfig
from finetune.errors import PipelineError
from finetune.workspace import Layout, atomic_dir, write_json_atomic


@dataclass
class Position:
    """Where the data stream is: resume restores exactly this."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast_dtype(cfg: FinetuneConfig, device: torch.device) -> torch.dtype | None:
    mp = cfg.training.mixed_precision
    if mp == "fp16" and device.type != "cuda":
        raise PipelineError(
            "training.mixed_precision: fp16 on CPU is refused (about 100x slower than fp32 "
            "here); use bf16 or fp32"
        )
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)


def total_steps(cfg: FinetuneConfig, steps_per_epoch: int) -> int:
    if cfg.total_steps_hint:
        return cfg.total_steps_hint
    return max(1, math.ceil(cfg.training.num_train_epochs * steps_per_epoch))


def train(cfg: FinetuneConfig, root: Path, mlflow_uri: str | None = None,
          run_id: str | None = None) -> dict[str, Any]:
    """Run training on this rank; rank 0 writes the trained model and metrics."""
    d = setup(cfg.distributed)
    try:
        return _train(cfg, root, d, mlflow_uri, run_id)
    finally:
        teardown()


def _train(cfg, root: Path, d: Dist, mlflow_uri, run_id):
    layout = Layout(root)
    t = cfg.training
    amp = autocast_dtype(cfg, d.device)
    configure_torch(t)
    seed_everything(t.seed)
    tok = load_tokenizer(cfg.model, root)
    base = load_base_model(cfg.model, root)
    enable_gradient_checkpointing(base, t)
    model = apply_peft(base, cfg.peft).to(d.device)
    trainable, total = count_parameters(model)
    collate_fn = _collate_fn(cfg, model, tok, d, amp)
    meter = CommMeter()
    strategy = build_strategy(cfg, d, meter)
    model = maybe_compile(strategy.wrap(model), t)
    train_ds = load_tokenized(layout.tokenized / "train")
    eval_ds = None
    if (layout.tokenized / "test").exists():
        eval_ds = load_tokenized(layout.tokenized / "test")
    accum = t.gradient_accumulation_steps
    lengths = tuple(len(x) for x in train_ds["input_ids"]) if t.group_by_length else None
    batches = ShardedBatches(len(train_ds), t.per_device_train_batch_size, d.rank, d.world_size,
                             t.seed, accum, lengths)
    steps_per_epoch = len(batches) // accum
    if steps_per_epoch == 0:
        raise PipelineError(
            f"train split has {len(train_ds)} rows, fewer than one optimizer step needs "
            f"({batches.global_batch * accum}); lower per_device_train_batch_size or "
            "gradient_accumulation_steps"
        )
    n_steps = total_steps(cfg, steps_per_epoch)
    optimizer = strategy.build_optimizer()
    scheduler = build_scheduler(optimizer, cfg.scheduler, n_steps)
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    pos, history = Position(), []
    monitor = Monitor.from_config(cfg)
    if cfg.checkpoint.resume_from_checkpoint:
        pos, history = _resume(layout.checkpoints, strategy, optimizer, scheduler, scaler, d,
                               monitor)
    sinks = MetricSinks(layout.plots, mlflow_uri, run_id, history) if d.is_main else None
    if d.is_main:
        print(f"[train] {trainable:,} trainable / {total:,} params; {n_steps} steps "
              f"({steps_per_epoch}/epoch); strategy {strategy.name}, world size {d.world_size}; "
              f"start step {pos.step}", flush=True)

    start_step = pos.step
    order = batches.epoch(pos.epoch)
    # The loss stays a device tensor until a logging step: no host sync per step.
    window = _new_window(d)
    # this rank's real tokens vs token slots computed (padding), examples vs rows (packing)
    fill = {"real": 0, "slots": 0, "examples": 0, "rows": 0}
    started = time.perf_counter()
    model.train()
    while pos.step < n_steps:
        micro = []
        for _ in range(accum):
            if pos.batch_in_epoch >= len(order):
                pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
                order = batches.epoch(pos.epoch)
            idx = order[pos.batch_in_epoch]
            pos.batch_in_epoch += 1
            rows = take_rows(train_ds, idx)
            real = sum(len(r["input_ids"]) for r in rows)
            window["tokens"] += real
            micro.append(collate_fn(rows))
            fill["real"] += real
            fill["slots"] += micro[-1]["input_ids"].numel()
            fill["examples"] += len(rows)
            fill["rows"] += micro[-1]["input_ids"].shape[0]
        local_targets = sum(count_targets(b) for b in micro)
        divisor = strategy.loss_divisor(local_targets, pos.step)
        for i, batch in enumerate(micro):
            batch = {k: v.to(d.device, non_blocking=True) for k, v in batch.items()}
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
        window["targets"] += local_targets
        window["steps"] += 1
        outer = strategy.after_optimizer_step(pos.step)
        if outer and sinks:
            sinks.log(pos.step, outer)

        if pos.step % cfg.logging.logging_steps == 0 or pos.step == n_steps or (
            pos.step == 1 and cfg.logging.logging_first_step
        ):
            _log_window(window, pos, d, sinks, scheduler, grad_norm, steps_per_epoch, accum,
                        meter)
        epoch_end, last = pos.batch_in_epoch >= len(order), pos.step == n_steps
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
            if sinks:
                sinks.log(pos.step, {"eval_loss": ev["loss"]})
        stop = monitor.should_stop and not last
        if save_now or (stop and c.save_strategy != "no"):
            _save(layout.checkpoints, cfg, strategy, optimizer, scheduler, scaler, pos, d, sinks,
                  monitor, evaluated)
        if stop:
            if d.is_main:
                print(f"[train] early stopping at step {pos.step}: {monitor.metric} has not "
                      f"improved by more than {monitor.threshold:g} for {monitor.bad_evals} "
                      f"evaluations (best {monitor.best:.6g} at step {monitor.best_step})",
                      flush=True)
            break

    runtime = time.perf_counter() - started
    comm = meter.summary(pos.step - start_step)  # this process's steps (resume starts later)
    result = {
        # the last training row (an eval row may come after it at the final step)
        "train_loss": next((r["loss"] for r in reversed(sinks.history) if "loss" in r), None)
        if sinks else None,
        "global_step": pos.step,
        "epoch": round(pos.epoch + pos.batch_in_epoch / max(len(order), 1), 4),
        "num_input_tokens_seen": pos.tokens_seen,
        "train_runtime": round(runtime, 3),
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
        result["loaded_best_step"] = _load_best(layout.checkpoints, strategy, optimizer, monitor, d)
    _write_trained(layout, cfg, strategy, tok, d)
    if d.is_main:
        print(f"[train] communication ({strategy.name}): {comm['comm_bytes_total'] / 1e6:.3f} MB "
              f"sent per rank, {comm['comm_bytes_per_step'] / 1e3:.1f} KB per optimizer step",
              flush=True)
        sinks.finish()
        write_json_atomic(layout.metrics / "train.json", result)
    if d.world_size > 1:
        torch.distributed.barrier()
    return result


def _collate_fn(cfg: FinetuneConfig, model, tok, d: Dist, amp):
    """Padded batches, or packed rows fed the way the probe found this model needs."""
    pad = tok.pad_token_id
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


def _log_window(window, pos, d, sinks, scheduler, grad_norm, steps_per_epoch, accum,
                meter: CommMeter) -> None:
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
    if sinks:
        sinks.log(pos.step, {
            "loss": loss_sum / max(targets, 1),
            "learning_rate": float(scheduler.get_last_lr()[0]),
            "grad_norm": float(grad_norm),
            "tokens_per_second": tokens / max(elapsed, 1e-9),
            "num_input_tokens_seen": pos.tokens_seen,
            "comm_bytes_per_step": comm / max(window["steps"], 1),
            "epoch": round(pos.epoch + pos.batch_in_epoch / max(steps_per_epoch * accum, 1), 4),
        })
    window.update(_new_window(d))


def _save(directory, cfg, strategy: Strategy, optimizer, scheduler, scaler, pos, d,
          sinks, monitor: Monitor, evaluated: dict) -> None:
    trainer_state = {
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler else None,
        "strategy": strategy.trainer_state(),
        "history": sinks.history if sinks else [],
        "monitor": monitor.state_dict(),
    }
    meta = {**pos.__dict__, "world_size": d.world_size, "strategy": strategy.name, **evaluated}
    path = ckpt.save(directory, pos.step, strategy.dcp_state(optimizer), trainer_state, meta,
                     cfg.checkpoint.save_total_limit, monitor.best_by)
    if d.is_main:
        print(f"[train] checkpoint {path}", flush=True)


def check_resumable(meta: dict, path: Path, world_size: int, strategy: str) -> None:
    """Exact resume needs the same world size (data shards, per-rank RNG) and strategy."""
    if meta.get("world_size") != world_size or meta.get("strategy", strategy) != strategy:
        raise PipelineError(
            f"checkpoint {path} was written by strategy {meta.get('strategy')} with world size "
            f"{meta.get('world_size')} but this run is {strategy} with world size {world_size}; "
            "resume with the same distributed.strategy and nproc_per_node x nnodes"
        )


def _load_best(directory, strategy: Strategy, optimizer, monitor: Monitor, d) -> int | None:
    """load_best_model_at_end: the best kept checkpoint's weights become the trained model."""
    path = ckpt.best(directory, monitor.best_by) if d.is_main else None
    if d.world_size > 1:
        chosen = [path]
        torch.distributed.broadcast_object_list(chosen, src=d.main_rank)
        path = chosen[0]
    if path is None:
        if d.is_main:
            print("[train] load_best_model_at_end: no checkpoint with a metric; keeping the "
                  "final weights", flush=True)
        return None
    _, meta = ckpt.load(path, strategy.dcp_state(optimizer),
                        lambda state: strategy.load_dcp_state(optimizer, state))
    if d.is_main:
        print(f"[train] load_best_model_at_end: {path.name} ({monitor.metric} "
              f"{meta.get(monitor.metric):.6g})", flush=True)
    return meta.get("step")


def _resume(directory, strategy: Strategy, optimizer, scheduler, scaler, d,
            monitor: Monitor) -> tuple[Position, list]:
    # One process hashes the checkpoint files and tells the others which one to load.
    path = ckpt.latest(directory) if d.is_main else None
    if d.world_size > 1:
        chosen = [path]
        torch.distributed.broadcast_object_list(chosen, src=d.main_rank)
        path = chosen[0]
    if path is None:
        if d.is_main:
            print(f"[train] resume_from_checkpoint: no valid checkpoint in {directory}; "
                  "starting from scratch", flush=True)
        return Position(), []
    meta = ckpt.read_meta(path) or {}
    check_resumable(meta, path, d.world_size, strategy.name)
    trainer_state, meta = ckpt.load(path, strategy.dcp_state(optimizer),
                                    lambda state: strategy.load_dcp_state(optimizer, state))
    scheduler.load_state_dict(trainer_state["scheduler"])
    if scaler and trainer_state.get("scaler"):
        scaler.load_state_dict(trainer_state["scaler"])
    strategy.load_trainer_state(trainer_state.get("strategy", {}))
    monitor.load_state_dict(trainer_state.get("monitor", {}))
    pos = Position(**{k: meta[k] for k in ("step", "epoch", "batch_in_epoch", "tokens_seen")})
    if d.is_main:
        print(f"[train] resumed from {path} at step {pos.step}", flush=True)
    return pos, trainer_state.get("history", [])
