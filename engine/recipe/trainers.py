"""Trainer types (`training.type`, QEfficient's name): which run class drives a job.

`sft` is `engine.recipe.run.TrainingRun`, the loop every strategy and option is built into;
`dpo` is `engine.recipe.dpo.run.DPORun`, preference tuning through the run's hooks. Each
method is one room under engine/recipe/ (its run, loss, batches and held-out metrics) plus one
line here; what the config and the stages know of it (the rows it trains on, the model it
trains) is registered beside its config section (finetune.config.methods). A
project can add its own loop (a subclass that overrides `train_step`, `evaluate`, ...) under a
key with `register_trainer("my-loop", MyRun)` in a module it imports, or name the class directly as
"module:Class". An unknown key is one line listing the registered ones.
"""

from __future__ import annotations

from engine.kinds import kind_of
from finetune.imports import load_object
from finetune.registry import Registry

#: training.type -> run class: sft (registered by engine.recipe.run) and one line per method
#: that ships with the engine, imported only when a run names it; every class looked up must
#: subclass the sft run (TrainingRun)
TRAINERS = Registry("trainer", "training.type", hint="",
                    base=lambda: TRAINERS.get("sft", check=False),
                    not_a_subclass="{key} '{name}': {obj!r} is not a subclass of "
                                   "engine.recipe.run.TrainingRun",
                    built_ins={"distill": "engine.recipe.distill.run:DistillRun",
                               "dpo": "engine.recipe.dpo.run:DPORun",
                               "grpo": "engine.recipe.grpo.run:GRPORun",
                               "kto": "engine.recipe.kto.run:KTORun",
                               "reward": "engine.recipe.reward.run:RewardRun",
                               "rloo": "engine.recipe.rloo.run:RLOORun"})


def register_trainer(key: str, cls=None):
    """`register_trainer("my-loop", MyRun)`, or as a class decorator."""
    return TRAINERS.register(key, cls)


def trainer_class(name: str):
    """training.type -> the run class (a registered name or 'module:Class'; an unknown one
    is one line listing the registered ones). engine.recipe.run registers its TrainingRun as
    `sft` when imported: call this through `engine.recipe.run.trainer_class`."""
    return TRAINERS.get(name)


def run_class(cfg):
    """The run class that trains `cfg` (a FinetuneConfig): its trainer type's, specialised by
    the kind of model it trains (engine.kinds: SFT of a classifier measures classes)."""
    ref = kind_of(cfg).run_classes.get(cfg.training.type)
    return load_object(ref, "training.type") if ref else trainer_class(cfg.training.type)
