"""Optimizer and LR schedule from the typed config (torch.optim class by name; HF schedules)."""

from __future__ import annotations

import re
from typing import Callable

import torch
from transformers import get_scheduler

from engine.objective.loraplus import ROLES, loraplus_lr, loraplus_role
from finetune.config.optim import OptimizerConfig, SchedulerConfig
from finetune.errors import PipelineError
from finetune.imports import load_object


def assign_groups(names: list[str], patterns: list[str]) -> list[list[int]]:
    """Indices of `names` per pattern (re.search, first match wins), then the unmatched rest."""
    compiled = [re.compile(p) for p in patterns]
    groups: list[list[int]] = [[] for _ in range(len(patterns) + 1)]
    for i, name in enumerate(names):
        hit = next((g for g, rx in enumerate(compiled) if rx.search(name)), len(patterns))
        groups[hit].append(i)
    return groups


def fused_default(klass, device: torch.device, kwargs: dict) -> dict:
    """On CUDA, the fused kernel where the optimizer has one (AdamW, Adam, SGD): one launch
    per step instead of a few per parameter group, no host sync; the user's own `fused` or
    `foreach` in optimizer.kwargs wins. Elsewhere torch's default (foreach)."""
    import inspect

    if device.type != "cuda" or {"fused", "foreach"} & set(kwargs):
        return {}
    return {"fused": True} if "fused" in inspect.signature(klass).parameters else {}


def optimizer_class(name: str, key: str = "optimizer.name"):
    """An optimizer key's class: a torch.optim class name, or 'module:Class' naming an
    Optimizer subclass (optimizer.name, distributed.diloco.outer_optimizer)."""
    if ":" not in name:
        return getattr(torch.optim, name)
    klass = load_object(name, key)
    if not (isinstance(klass, type) and issubclass(klass, torch.optim.Optimizer)):
        raise PipelineError(f"{key}: '{name}' is not a torch.optim.Optimizer subclass")
    return klass


def scheduler_factory(name: str):
    """scheduler.name 'module:function' -> the function (a schedule name: None)."""
    if ":" not in name:
        return None
    fn = load_object(name, "scheduler.name")
    if not callable(fn):
        raise PipelineError(f"scheduler.name: '{name}' is not a function")
    return fn


def build_optimizer(named_params, cfg: OptimizerConfig,
                    log: Callable[[str], None] | None = None,
                    model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """optimizer.name over the trainable parameters, split into `optimizer_groups`, and each
    group into its LoRA+ parts (A, embedding, B rates) when optimizer.loraplus_lr_ratio is
    set; `model`: the module the names are of (LoRA+ looks their layers up in it)."""
    klass = optimizer_class(cfg.name)
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if not named:
        raise PipelineError("no trainable parameters: check peft.target_modules / peft.use_peft")
    kwargs = {"lr": cfg.learning_rate, **fused_default(klass, named[0][1].device, cfg.kwargs),
              **cfg.kwargs}
    if cfg.weight_decay:
        kwargs["weight_decay"] = cfg.weight_decay
    names = [n for n, _ in named]
    roles = None
    if cfg.loraplus_lr_ratio is not None:
        if model is None:
            raise PipelineError("optimizer.loraplus_lr_ratio: the optimizer was built without "
                                "the model its parameters belong to")
        roles = [loraplus_role(model, n, p) for n, p in named]
    patterns = list(cfg.optimizer_groups)
    groups = []
    for g, members in enumerate(assign_groups(names, patterns)):
        if g < len(patterns) and not members:
            raise PipelineError(
                f"optimizer.optimizer_groups['{patterns[g]}']: matches no trainable parameter"
                f"{' left by the earlier patterns' if g else ''} (names look like "
                f"{names[0]!r}); fix the regex or remove the group"
            )
        overrides = cfg.optimizer_groups[patterns[g]] if g < len(patterns) else {}
        parts = [(None, members)] if roles is None else [
            (role, [i for i in members if roles[i] == role]) for role in ROLES]
        for role, part in parts:
            if not part:
                continue
            rate = {} if role in (None, "A") else {
                "lr": loraplus_lr(role, overrides.get("lr", cfg.learning_rate), cfg)}
            groups.append({"params": [named[i][1] for i in part], **overrides, **rate})
            if log:
                label = f"'{patterns[g]}' {overrides}" if g < len(patterns) else "default"
                label += f" LoRA+ {role} lr {groups[-1].get('lr', kwargs['lr']):g}" if role else ""
                shown = ", ".join(names[i] for i in part[:4])
                more = f" (+{len(part) - 4} more)" if len(part) > 4 else ""
                log(f"[optimizer] group {label}: {len(part)} tensors: {shown}{more}")
    try:
        optimizer = klass(groups, **kwargs)
    except TypeError as exc:
        raise PipelineError(f"optimizer.kwargs: {cfg.name} rejects them ({exc})") from None
    for pattern, overrides in cfg.optimizer_groups.items():
        unknown = sorted(set(overrides) - set(optimizer.defaults))
        if unknown:  # torch keeps unknown group keys silently; an ignored option is a bug
            raise PipelineError(
                f"optimizer.optimizer_groups['{pattern}'].{unknown[0]}: {cfg.name} has no "
                f"such option (it has: {', '.join(sorted(optimizer.defaults))})"
            )
    return optimizer


def warmup_steps(cfg: SchedulerConfig, total_steps: int) -> int:
    return cfg.warmup_steps or int(round(cfg.warmup_ratio * total_steps))


def build_scheduler(optimizer, cfg: SchedulerConfig, total_steps: int):
    kwargs = dict(cfg.kwargs)
    factory = scheduler_factory(cfg.name)
    if factory is not None:
        try:
            scheduler = factory(optimizer, num_warmup_steps=warmup_steps(cfg, total_steps),
                                num_training_steps=total_steps, **kwargs)
        except TypeError as exc:
            raise PipelineError(f"scheduler.name: '{cfg.name}' cannot be called as f(optimizer, "
                                f"num_warmup_steps=, num_training_steps=, **kwargs) ({exc})"
                                ) from None
        if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict",
                                                                     "load_state_dict")):
            raise PipelineError(f"scheduler.name: '{cfg.name}' returned "
                                f"{type(scheduler).__name__}, not an LR scheduler")
        return scheduler
    if cfg.name == "warmup_stable_decay":
        kwargs.setdefault("num_decay_steps", max(1, total_steps // 10))
    warmup = warmup_steps(cfg, total_steps)
    try:
        scheduler = get_scheduler(
            cfg.name,
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total_steps,
            scheduler_specific_kwargs=kwargs,
        )
    except TypeError as exc:
        raise PipelineError(f"scheduler.kwargs: '{cfg.name}' rejects them ({exc})") from None
    if cfg.warmup_type == "log" and warmup > 0:
        scheduler.lr_lambdas = [log_warmup(f, warmup) for f in scheduler.lr_lambdas]
    return scheduler


def log_warmup(after: Callable[[int], float], warmup: int) -> Callable[[int], float]:
    """DeepSpeed's WarmupLR warmup (its default, warmup_type "log") as DeepSpeed steps it:
    the first optimizer step at 0 (its scheduler starts below step 0), then the peak times
    log(step) / log(warmup) up to step `warmup` (at least 2 for the log, as DeepSpeed
    takes), then the schedule's own factor. A plain function: LambdaLR's state_dict keeps only
    the step for it, so resume is unchanged."""
    import math

    steps = max(2, warmup)
    inverse = 1.0 / math.log(steps)

    def factor(step: int) -> float:
        if step < steps:
            return math.log(step) * inverse if step > 0 else 0.0
        return after(step)
    return factor
