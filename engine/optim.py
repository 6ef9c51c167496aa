"""Optimizer and LR schedule from the typed config (torch.optim class by name; HF schedules)."""

from __future__ import annotations

import torch
from transformers import get_scheduler

from finetune.config.schema import OptimizerConfig, SchedulerConfig
from finetune.errors import PipelineError


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    klass = getattr(torch.optim, cfg.name)
    params = [p for p in params if p.requires_grad]
    if not params:
        raise PipelineError("no trainable parameters: check peft.target_modules / peft.use_peft")
    kwargs = {"lr": cfg.learning_rate, **cfg.kwargs}
    if cfg.weight_decay:
        kwargs["weight_decay"] = cfg.weight_decay
    try:
        return klass(params, **kwargs)
    except TypeError as exc:
        raise PipelineError(f"optimizer.kwargs: {cfg.name} rejects them ({exc})") from None


def warmup_steps(cfg: SchedulerConfig, total_steps: int) -> int:
    return cfg.warmup_steps or int(round(cfg.warmup_ratio * total_steps))


def build_scheduler(optimizer, cfg: SchedulerConfig, total_steps: int):
    kwargs = dict(cfg.kwargs)
    if cfg.name == "warmup_stable_decay":
        kwargs.setdefault("num_decay_steps", max(1, total_steps // 10))
    try:
        return get_scheduler(
            cfg.name,
            optimizer,
            num_warmup_steps=warmup_steps(cfg, total_steps),
            num_training_steps=total_steps,
            scheduler_specific_kwargs=kwargs,
        )
    except TypeError as exc:
        raise PipelineError(f"scheduler.kwargs: '{cfg.name}' rejects them ({exc})") from None
