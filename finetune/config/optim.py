"""The `optimizer` and `scheduler` sections: a torch.optim class (or a project's) with its
kwargs and parameter groups, and a transformers LR schedule. engine/objective/optim.py consumes them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from finetune.config import compat
from finetune.config.distributed import torch_optimizer_name
from finetune.config.section import Field, Section, did_you_mean

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "cosine_with_min_lr",  # kwargs min_lr_rate (DeepSpeed's WarmupCosineLR cos_min_ratio)
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
)


class OptimizerConfig(Section):
    """Any torch.optim class by name plus its keyword arguments."""

    name: str = Field(
        "AdamW", fingerprint=True,
        description="torch.optim class name (AdamW, Adam, SGD, ...), or 'module:Class' "
        "for another torch.optim.Optimizer (e.g. bitsandbytes.optim:AdamW8bit, or yours).")
    learning_rate: float = Field(1e-3, fingerprint=True, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, fingerprint=True, ge=0, description="Weight decay.")
    kwargs: dict[str, Any] = Field(
        fingerprint=True, default_factory=dict, description="Extra optimizer kwargs.")
    optimizer_groups: dict[str, dict[str, Any]] = Field(
        fingerprint=True, default_factory=dict,
        description="Regex on parameter names -> that group's overrides (e.g. "
        "'norm|bias|embed': {weight_decay: 0.0}); first match wins, the rest use the values "
        "above; a regex left with no parameter is an error.",
    )
    loraplus_lr_ratio: float | None = Field(
        None, fingerprint=True, gt=0,
        description="LoRA+ (peft's create_loraplus_optimizer rule): the LoRA B matrices (and "
        "other trained vectors) learn at this many times their group's rate, A matrices at "
        "the group's rate; the paper suggests 16. null: off.")
    loraplus_lr_embedding: float | None = Field(
        None, fingerprint=True, gt=0,
        description="LoRA+: the learning rate of LoRA matrices on an embedding layer "
        "(peft.target_modules naming it); null: peft's 1e-6.")
    log_param_groups: bool = Field(
        False, fingerprint=False, description="Print which parameters each optimizer group got."
    )

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, name: str) -> str:
        return torch_optimizer_name(name)

    @field_validator("optimizer_groups")
    @classmethod
    def _valid_groups(cls, groups: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        import re

        for pattern, overrides in groups.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"'{pattern}' is not a valid regular expression ({exc})") from None
            if "learning_rate" in overrides:  # the config's name for torch's `lr`
                overrides["lr"] = overrides.pop("learning_rate")
            if "params" in overrides:
                raise ValueError(f"'{pattern}': 'params' is chosen by the regex, not set")
        return groups


class SchedulerConfig(Section):
    """Learning-rate schedule built with transformers.get_scheduler."""

    name: str = Field(
        "cosine", fingerprint=True,
        description="Schedule (HF lr_scheduler_type: " + ", ".join(SCHEDULERS) + "), "
        "or 'module:function' called as f(optimizer, num_warmup_steps=, num_training_steps=, "
        "**kwargs) and returning a torch LR scheduler.")

    @field_validator("name")
    @classmethod
    def _known_schedule(cls, name: str) -> str:
        if name not in SCHEDULERS and ":" not in name:
            raise ValueError(f"'{name}' is not a schedule{did_you_mean(name, SCHEDULERS)} "
                             f"({', '.join(SCHEDULERS)}) nor a "
                             "'module:function'")
        return name
    warmup_steps: int = Field(
        0, fingerprint=True, ge=0, description="Warmup steps (exclusive with warmup_ratio).")
    warmup_ratio: float = Field(
        0.0, fingerprint=True, ge=0, lt=1, description="Warmup as a fraction of steps.")
    warmup_type: Literal["linear", "log"] = Field(
        "linear", fingerprint=True,
        description="How the warmup rises: linear (transformers' schedules), or log, "
        "DeepSpeed's WarmupLR default (log(step + 1) / log(warmup steps) of the peak), which a "
        "DeepSpeed config without warmup_type asks for.")
    kwargs: dict[str, Any] = Field(
        fingerprint=True,
        default_factory=dict, description="scheduler_specific_kwargs (e.g. num_cycles, power)."
    )

    @model_validator(mode="after")
    def _compat(self) -> "SchedulerConfig":
        compat.check(self, "scheduler")
        return self
