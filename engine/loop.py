"""The training recipe: one readable loop; components come from the engine modules.

Loss is token-weighted across micro-batches *and* ranks: each step's summed loss is divided by
the number of target tokens in the whole global batch (counted before the backward passes), so
gradient accumulation and world size do not change the objective (HF's accumulation bug).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import checkpoint as ckpt
from engine.data import (ShardedBatches, collate, count_targets, load_tokenized, take_rows,
                         token_loss_sum)
from engine.distributed import Dist, all_reduce_sum, setup, teardown, unwrap, wrap_model
from engine.evaluation import evaluate_loss
from engine.model import (apply_peft, count_parameters, load_base_model, load_tokenizer,
                          make_adapter_config_reproducible)
from engine.optim import build_optimizer, build_scheduler
from engine.sinks import MetricSinks
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
    if cfg.training.max_steps > 0:
        return cfg.training.max_steps
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
    seed_everything(t.seed)
    tok = load_tokenizer(cfg.model, root)
    model = apply_peft(load_base_model(cfg.model, root), cfg.peft).to(d.device)
    trainable, total = count_parameters(model)
    train_ds = load_tokenized(layout.tokenized / "train")
    eval_ds = None
    if (layout.tokenized / "test").exists():
        eval_ds = load_tokenized(layout.tokenized / "test")
    batches = ShardedBatches(len(train_ds), t.per_device_train_batch_size, d.rank, d.world_size,
                             t.seed)
    accum = t.gradient_accumulation_steps
    steps_per_epoch = len(batches) // accum
    if steps_per_epoch == 0:
        raise PipelineError(
            f"train split has {len(train_ds)} rows, fewer than one optimizer step needs "
            f"({batches.global_batch * accum}); lower per_device_train_batch_size or "
            "gradient_accumulation_steps"
        )
    n_steps = total_steps(cfg, steps_per_epoch)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, n_steps)
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    pos, history = Position(), []
    if cfg.checkpoint.resume_from_checkpoint:
        pos, history = _resume(layout.checkpoints, model, optimizer, scheduler, scaler, d)
    wrapped = wrap_model(model, cfg.distributed, d)
    sinks = MetricSinks(layout.plots, mlflow_uri, run_id, history) if d.is_main else None
    if d.is_main:
        print(f"[train] {trainable:,} trainable / {total:,} params; {n_steps} steps "
              f"({steps_per_epoch}/epoch); world size {d.world_size}; start step {pos.step}",
              flush=True)

    order = batches.epoch(pos.epoch)
    # The loss stays a device tensor until a logging step: no host sync per step.
    window = {"loss_sum": torch.zeros((), dtype=torch.float64, device=d.device), "targets": 0,
              "tokens": 0, "t0": time.perf_counter()}
    started = time.perf_counter()
    wrapped.train()
    while pos.step < n_steps:
        micro = []
        for _ in range(accum):
            if pos.batch_in_epoch >= len(order):
                pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
                order = batches.epoch(pos.epoch)
            idx = order[pos.batch_in_epoch]
            pos.batch_in_epoch += 1
            micro.append(collate(take_rows(train_ds, idx), tok.pad_token_id))
        targets = all_reduce_sum(sum(count_targets(b) for b in micro), d)
        window["tokens"] += sum(int(b["attention_mask"].sum()) for b in micro)  # CPU tensors
        for i, batch in enumerate(micro):
            batch = {k: v.to(d.device, non_blocking=True) for k, v in batch.items()}
            sync = i == accum - 1 or not hasattr(wrapped, "no_sync")
            with (contextlib.nullcontext() if sync else wrapped.no_sync()):
                with torch.autocast(d.device.type, dtype=amp, enabled=amp is not None):
                    logits = wrapped(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"]).logits
                loss_sum = token_loss_sum(logits, batch["labels"])
                loss = loss_sum * (d.world_size / max(targets, 1))
                (scaler.scale(loss) if scaler else loss).backward()
            window["loss_sum"] += loss_sum.detach().double()
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        pos.step += 1
        window["targets"] += int(targets)

        if pos.step % cfg.logging.logging_steps == 0 or pos.step == n_steps or (
            pos.step == 1 and cfg.logging.logging_first_step
        ):
            _log_window(window, pos, d, sinks, scheduler, grad_norm, steps_per_epoch, accum)
        if cfg.eval.eval_strategy == "steps" and eval_ds is not None and (
            pos.step % cfg.eval.eval_steps == 0 or pos.step == n_steps
        ):
            ev = evaluate_loss(unwrap(wrapped), eval_ds, t.per_device_eval_batch_size, tok.pad_token_id,
                               d, cfg.eval.eval_batches, amp)
            if sinks:
                sinks.log(pos.step, {"eval_loss": ev["loss"]})
        if cfg.checkpoint.save_strategy == "steps" and (
            pos.step % cfg.checkpoint.save_steps == 0 or pos.step == n_steps
        ):
            _save(layout.checkpoints, cfg, model, optimizer, scheduler, scaler, pos, d, sinks)

    runtime = time.perf_counter() - started
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
    }
    if d.is_main:
        make_adapter_config_reproducible(unwrap(wrapped), cfg.model)
        with atomic_dir(layout.trained) as staging:
            unwrap(wrapped).save_pretrained(staging, safe_serialization=True)
            tok.save_pretrained(staging)
        sinks.finish()
        write_json_atomic(layout.metrics / "train.json", result)
    if d.world_size > 1:
        torch.distributed.barrier()
    return result


def _log_window(window, pos, d, sinks, scheduler, grad_norm, steps_per_epoch, accum) -> None:
    loss_sum = all_reduce_sum(float(window["loss_sum"]), d)
    tokens = int(all_reduce_sum(window["tokens"], d))
    pos.tokens_seen += tokens
    elapsed = time.perf_counter() - window["t0"]
    if sinks:
        sinks.log(pos.step, {
            "loss": loss_sum / max(window["targets"], 1),
            "learning_rate": float(scheduler.get_last_lr()[0]),
            "grad_norm": float(grad_norm),
            "tokens_per_second": tokens / max(elapsed, 1e-9),
            "num_input_tokens_seen": pos.tokens_seen,
            "epoch": round(pos.epoch + pos.batch_in_epoch / max(steps_per_epoch * accum, 1), 4),
        })
    window["loss_sum"].zero_()
    window.update(targets=0, tokens=0, t0=time.perf_counter())


def _trainable_state(model) -> dict[str, torch.Tensor]:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in names}


def _save(directory, cfg, model, optimizer, scheduler, scaler, pos, d, sinks) -> None:
    if d.is_main:
        state = {
            "model": _trainable_state(model),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler else None,
            "rng": ckpt.rng_state(),
            "history": sinks.history if sinks else [],
        }
        meta = {**pos.__dict__, "world_size": d.world_size}
        path = ckpt.save(directory, pos.step, state, meta, cfg.checkpoint.save_total_limit)
        print(f"[train] checkpoint {path}", flush=True)
    if d.world_size > 1:
        torch.distributed.barrier()


def _resume(directory, model, optimizer, scheduler, scaler, d) -> tuple[Position, list]:
    path = ckpt.latest(directory)
    if path is None:
        if d.is_main:
            print(f"[train] resume_from_checkpoint: no valid checkpoint in {directory}; "
                  "starting from scratch", flush=True)
        return Position(), []
    state, meta = ckpt.load(path)
    if meta.get("world_size") != d.world_size:
        raise PipelineError(
            f"checkpoint {path} was written with world size {meta.get('world_size')} but this run "
            f"has {d.world_size}; resume with the same distributed.nproc_per_node x nnodes"
        )
    missing = set(_trainable_state(model)) - set(state["model"])
    if missing:
        raise PipelineError(
            f"checkpoint {path} does not match the model ({len(missing)} trainable tensors "
            f"missing, e.g. {sorted(missing)[0]}); was peft/model config changed?"
        )
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    ckpt.set_rng_state(state["rng"])
    pos = Position(**{k: meta[k] for k in ("step", "epoch", "batch_in_epoch", "tokens_seen")})
    if d.is_main:
        print(f"[train] resumed from {path} at step {pos.step}", flush=True)
    return pos, state.get("history", [])
