"""The `registry` section: the MLflow Model Registry gate, which version takes the champion
alias (the gate metric, the minimum improvement, no-regression guards, contamination), and
the metric names the gate can read.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from finetune.config.section import Section, did_you_mean
from finetune.datatypes.metrics import (
    CLASSIFICATION_METRICS,
    PREFERENCE_METRICS,
    ROUGE_KEYS,
    UNPAIRED_METRICS,
)

GATE_METRICS = ("eval.loss", "eval.perplexity", "eval.exact_match",
                *(f"eval.{k}" for k in ROUGE_KEYS), *(f"eval.{k}" for k in CLASSIFICATION_METRICS),
                *(f"eval.{k}" for k in PREFERENCE_METRICS),
                *(f"eval.{k}" for k in UNPAIRED_METRICS if k not in PREFERENCE_METRICS))


#: a harness metric the gate can name: eval.harness.<task>.<metric>.<filter>
HARNESS_GATE = re.compile(r"eval\.harness\.[^.\s]+\.[^.\s]+\.[^.\s]+")


def stderr_key(metric: str) -> str:
    """Where a metric's standard error is: lm-eval's `<metric>_stderr,<filter>` for a harness
    metric (eval.harness.TASK.METRIC_stderr.FILTER), else `<metric>_stderr`."""
    if HARNESS_GATE.fullmatch(metric):
        head, filt = metric.rsplit(".", 1)
        return f"{head}_stderr.{filt}"
    return f"{metric}_stderr"


def _check_metric(name: str) -> str:
    from finetune.config.methods import is_method_metric

    if name in GATE_METRICS or HARNESS_GATE.fullmatch(name) or is_method_metric(
            name.removeprefix("eval.")):
        return name
    raise ValueError(f"unknown metric '{name}'{did_you_mean(name, GATE_METRICS)}: one of "
                     f"{', '.join(GATE_METRICS)}, a training method's own (grpo: "
                     "eval.reward, eval.reward_NAME, eval.sampled_reward_NAME, eval.pass_at_K), or "
                     "eval.harness.TASK.METRIC.FILTER")


#: metric names that are better lower (lm-eval's perplexity tasks report the last two)
LOWER_IS_BETTER = ("loss", "perplexity", "bits_per_byte")


def higher_wins(metric: str) -> bool:
    """A metric's inferred direction: loss, perplexity and bits per byte are better lower, the
    rest higher. A harness metric's name is its METRIC part (eval.harness.TASK.METRIC.FILTER)."""
    name = metric.split(".")[3] if HARNESS_GATE.fullmatch(metric) else metric
    return not name.endswith(LOWER_IS_BETTER)


class GuardMetric(Section):
    """A metric the new model must not get worse at, by more than an allowance, to replace the
    champion (a no-regression guard). Its direction is inferred as gate_metric's is."""

    metric: str = Field(..., description="Metric to guard (the names gate_metric takes).")
    max_drop: float | None = Field(
        None, ge=0, description="Allowed drop from the champion, in the metric's units.")
    max_drop_stderr: float | None = Field(
        None, ge=0, description="Allowed drop in standard errors of the difference "
        "(sqrt(se_champion^2 + se_candidate^2)); the metric must report a stderr (harness "
        "metrics do; ours by bootstrap, eval.bootstrap_samples).")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, name: str) -> str:
        return _check_metric(name)

    @property
    def higher_wins(self) -> bool:
        return higher_wins(self.metric)


class RegistryConfig(Section):
    """MLflow Model Registry: every export is a version; aliases say which one serves.

    The new version gets `candidate_alias`; it also gets `champion_alias` when there is no
    champion yet or when its `gate_metric` beats the champion's by at least `min_improvement`.
    """

    register_model: bool = Field(True, description="Log the export to MLflow and register it.")
    registered_model_name: str | None = Field(
        None, description="Registry name (default: logging.experiment_name)."
    )
    gate_metric: str = Field(
        "eval.loss", description="Metric of the fine-tuned model that decides promotion "
        "(unset: the method's own: eval.loss for sft, eval.preference_accuracy for dpo and "
        "reward, eval.kto_accuracy for kto, eval.reward for grpo): "
        f"{', '.join(GATE_METRICS)} (eval.accuracy / eval.macro_f1: classification datasets; "
        "eval.preference_accuracy, reward_margin, likelihood_accuracy, logp_margin: preference "
        "pairs; eval.kto_accuracy, desirable_accuracy, undesirable_accuracy, reward_margin: "
        "unpaired preferences), or a harness metric eval.harness.TASK.METRIC.FILTER (e.g. eval.harness."
        "gsm8k_local.exact_match.strict-match; set greater_is_better for one where lower wins)."
    )
    greater_is_better: bool | None = Field(
        None, description="Direction of gate_metric (None: inferred; loss/perplexity lower)."
    )
    min_improvement: float = Field(
        0.0, ge=0, description="Absolute improvement over the champion needed to promote."
    )
    min_improvement_stderr: float = Field(
        0.0, ge=0, description="Improvement over the champion needed to promote, in standard "
        "errors of the difference (0: none; gate_metric must report a stderr: harness metrics "
        "do, ours by bootstrap, eval.bootstrap_samples). Both this and min_improvement must be met.")
    guard_metrics: list[GuardMetric] = Field(
        default_factory=list, description="No-regression guards: promotion also needs every "
        "one to hold, i.e. the new model is not worse than the champion at `metric` by more "
        "than `max_drop` (absolute) or `max_drop_stderr` (standard errors); set exactly one. "
        "Each verdict is recorded (model-version tags gate.*, artifact gate/decision.json).")
    max_contamination: float | None = Field(
        None, ge=0, le=1, description="Refuse promotion when any evaluation set's "
        "contamination.<set>.overlap_fraction (the evaluate stage's check: the share of its "
        "rows sharing an n-gram with the training rows) is above this; None: not gated.")
    candidate_alias: str = Field("candidate", description="Alias every new version gets.")
    champion_alias: str = Field("champion", description="Alias of the version in service.")

    @field_validator("gate_metric")
    @classmethod
    def _known_metric(cls, name: str) -> str:
        return _check_metric(name)

    @property
    def higher_wins(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        return higher_wins(self.gate_metric)

    @model_validator(mode="after")
    def _compat(self) -> "RegistryConfig":
        from finetune.config import compat

        compat.check(self, "registry")
        return self
