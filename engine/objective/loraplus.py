"""LoRA+ (optimizer.loraplus_lr_ratio): the B matrices learn faster than the A matrices.

peft's `create_loraplus_optimizer` builds its own four parameter groups from a PeftModel, so
it cannot split the regex groups of `optimizer.optimizer_groups`; its rule is applied here
instead, per parameter, so each regex group splits into its A, B and embedding parts. The rule
is peft's: a parameter held by a LoRA embedding layer (peft's `lora.Embedding`, found by the
parameter's name less its last two parts) learns at `loraplus_lr_embedding`, a `lora_B`
matrix or any other trained vector at ratio x its group's rate, everything else (A matrices,
trainable token rows, layers trained in full) at its group's rate. The layer is looked up by
name in the module the optimizer is built on, so the names of a DDP or FSDP2 model (same
module paths, sharded DTensor parameters keep their full `ndim`) classify as a single
process's do.
"""

from __future__ import annotations

import torch

from finetune.config.optim import OptimizerConfig

#: the parts of a group, in peft's order of its groups
ROLES = ("A", "embedding", "B")

#: peft's create_loraplus_optimizer default for `loraplus_lr_embedding`
PEFT_EMBEDDING_LR = 1e-6


def loraplus_role(model: torch.nn.Module, name: str, param: torch.Tensor) -> str:
    """Which LoRA+ rate `name` (a parameter of `model`) learns at: A, B or embedding."""
    from peft.tuners.lora.layer import Embedding

    holder = ".".join(name.split(".")[:-2])
    if holder and isinstance(model.get_submodule(holder), Embedding):
        return "embedding"
    if "lora_B" in name or param.ndim == 1:
        return "B"
    return "A"


def loraplus_lr(role: str, group_lr: float, cfg: OptimizerConfig) -> float:
    """The learning rate of a group's `role` part, its group's own being `group_lr`."""
    if role == "B":
        return group_lr * cfg.loraplus_lr_ratio
    if role == "embedding":
        return (cfg.loraplus_lr_embedding if cfg.loraplus_lr_embedding is not None
                else PEFT_EMBEDDING_LR)
    return group_lr
