"""What the pipeline knows of a training method (`training.type`) before any engine code runs:
which rows it trains on, and which model it trains.

The run class that trains is the engine's (engine.recipe.trainers); these are the facts the
config, the stages and the compatibility table need without importing it (imports go one way:
the engine below the stages, this base below both), the way TRL keeps a trainer's
`*_config.py` beside its `*_trainer.py`. A built-in method registers its facts next to its
config section (finetune/config/preference.py for dpo); a project's own run class, named as
`module:Class`, may carry them as a class attribute `method = Method(...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from finetune.datatypes.base import TARGETS, ModelTask


@dataclass(frozen=True)
class Method:
    name: str
    #: the dataset targets it trains on (finetune.datatypes.base.TARGETS); None: any (a
    #: project's loop that declares nothing is not second-guessed)
    accepts: tuple[str, ...] | None = ("tokens", "labels")
    #: the model it trains when that is not the dataset type's (a reward model's one-output
    #: head); None: the dataset type's
    task: ModelTask | None = None
    #: the refusal's advice when the data is not one it trains on ("" : a generic one)
    data_hint: str = ""
    #: config -> the evaluate stage's metrics when this method's evaluation replaces the
    #: dataset type's (GRPO's rewards and pass rates: no loss or text-match metrics of its
    #: prompt rows), so the registry gate may name them and no other; None: the type's
    metrics: Callable[[object], tuple[str, ...]] | None = None
    #: a regex every such metric name matches, so `registry.gate_metric` can name one before
    #: the whole config is known (the config-wide rule then checks the exact name)
    metric_pattern: str | None = None
    #: (config, metric name without `eval.`) -> whether the evaluate stage reports a standard
    #: error for it, where this method's numbers decide (None: the dataset's rule, see
    #: finetune.config.compat.has_stderr); None: the dataset's rule for every metric
    stderr: Callable[[object, str], bool | None] | None = None
    #: the config sections only this method's runs read; None: the section named as the
    #: method, if there is one (`grpo` for grpo). What the stages do for a marked key in one
    #: (a model reference resolved and checked: finetune.config.model_refs) is done in this
    #: method's runs only, as its run is the only one that loads it
    sections: tuple[str, ...] | None = None
    #: config -> the 'module:function' tools the method's rollouts call, whose schemas the
    #: format stage renders into the prompts where data.tools names none (GRPO's grpo.tools,
    #: as TRL renders its `tools=`); None: the prompts' tools are data.tools only
    prompt_tools: Callable[[object], list[str]] | None = None
    #: config -> the environments the method's rollouts act in ('module:Class', or a mapping
    #: of names to them chosen by each row's `environment` column), whose methods are tools
    #: too (GRPO's grpo.environment_factory, TRL's environment_factory=); None: none
    prompt_environments: Callable[[object], str | dict[str, str] | None] | None = None
    #: the registry's gate metric when the params file names none (`registry.gate_metric`):
    #: one this method's evaluation reports (GRPO's eval.reward); None: eval.loss
    default_gate: str | None = None
    #: whether its in-training evaluation is the SFT run's (the held-out loss, and with
    #: eval.during_training_metrics the generation metrics: engine.recipe.sft.in_training);
    #: a method that evaluates with its own numbers during training (DPO's rewards, GRPO's)
    #: says False
    sft_evaluation: bool = False

    @property
    def own_sections(self) -> tuple[str, ...]:
        return (self.name,) if self.sections is None else self.sections

    def reported(self, cfg) -> tuple[str, ...]:
        return self.metrics(cfg) if self.metrics else ()

    def __post_init__(self):
        unknown = set(self.accepts or ()) - set(TARGETS)
        if unknown:
            raise ValueError(f"method '{self.name}': accepts unknown targets {sorted(unknown)} "
                             f"(known: {', '.join(TARGETS)})")

    def refusal(self, datatype) -> str | None:
        """One line when this method does not train on `datatype`'s rows, else None."""
        if self.accepts is None or datatype.targets in self.accepts:
            return None
        if self.data_hint:
            return f"training.type: {self.name} {self.data_hint}"
        if datatype.trainer_hint:
            return f"data.dataset_type: {datatype.name} {datatype.trainer_hint}"
        return (f"training.type: {self.name} trains on {' or '.join(self.accepts)} rows; "
                f"data.dataset_type {datatype.name} gives {datatype.targets}")


_METHODS: dict[str, Method] = {}


def is_method_metric(name: str) -> bool:
    """Whether `name` (without `eval.`) is a metric some registered method can report."""
    import re

    return any(m.metric_pattern and re.fullmatch(m.metric_pattern, name)
               for m in _METHODS.values())


def method_names() -> list[str]:
    """The registered methods' names (`training.type` values), in registration order."""
    return list(_METHODS)


def register_method(method: Method) -> Method:
    _METHODS[method.name] = method
    return method


def reads_section(training_type: str, section: str) -> bool:
    """Whether a run of `training_type` reads the params' `section`: a section that is a
    registered method's own (`Method.own_sections`) only that method's runs do (a project's
    `module:Class` run class, only when its `method` says so); any other section, every run."""
    if not any(section in m.own_sections for m in _METHODS.values()):
        return True
    return section in method_of(training_type).own_sections


def method_of(name: str) -> Method:
    """The facts of `training.type` `name`: a registered method's, a `module:Class` run
    class's own `method` attribute (else unchecked), or an unknown name's defaults (the
    engine refuses an unknown name before launch, with the registered ones listed)."""
    if name in _METHODS:
        return _METHODS[name]
    if ":" in name:
        from finetune.imports import load_object

        try:
            declared = getattr(load_object(name, "training.type"), "method", None)
        except Exception:  # the engine's check names the broken reference (engine.preflight)
            declared = None
        return declared if isinstance(declared, Method) else Method(name, accepts=None)
    return Method(name, accepts=None)


register_method(Method("sft", sft_evaluation=True))
