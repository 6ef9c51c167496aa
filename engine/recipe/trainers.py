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

from typing import Any

from finetune.errors import PipelineError
from finetune.imports import load_object

TRAINERS: dict[str, Any] = {}
#: the trainer types that ship with the engine besides sft, imported when a run names them
BUILT_IN = {"dpo": "engine.recipe.dpo.run:DPORun"}
#: a method whose room differs by the model it trains: (training.type, the model task's
#: pipeline tag) -> its run class (SFT of a sequence classifier measures classes, not text)
BY_TASK = {("sft", "text-classification"): "engine.recipe.classifier.run:ClassifierRun"}


def register_trainer(key: str, cls: Any = None):
    """`register_trainer("my-loop", MyRun)`, or as a class decorator."""
    def add(klass):
        TRAINERS[key] = klass
        return klass

    return add(cls) if cls is not None else add


def trainer_class(name: str):
    """training.type -> the run class. engine.recipe.run registers its TrainingRun as `sft` when
    imported: call this through `engine.recipe.run.trainer_class`."""
    if ":" in name or name in BUILT_IN:
        klass = load_object(BUILT_IN.get(name, name), "training.type")
    elif name in TRAINERS:
        klass = TRAINERS[name]
    else:
        raise PipelineError(f"training.type '{name}': no such trainer (registered: "
                            f"{', '.join(sorted({*TRAINERS, *BUILT_IN}))}; or name a class as "
                            "'module:Class')")
    if not (isinstance(klass, type) and issubclass(klass, TRAINERS["sft"])):
        raise PipelineError(f"training.type '{name}': {klass!r} is not a subclass of "
                            "engine.recipe.run.TrainingRun")
    return klass


def run_class(cfg):
    """The run class that trains `cfg` (a FinetuneConfig): its trainer type's, specialised by
    the model it trains (BY_TASK)."""
    ref = BY_TASK.get((cfg.training.type, cfg.model_task.pipeline_tag))
    return load_object(ref, "training.type") if ref else trainer_class(cfg.training.type)
