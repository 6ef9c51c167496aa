"""Config of what a run produces after training: evaluation, the exported model, the registry.

Kept apart from the training sections because these keys drive the evaluate and export stages
only (dvc.yaml tracks them per stage, so changing a generation setting never retrains).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from finetune.config.section import Section, did_you_mean
from finetune.datatypes.metrics import (
    CLASSIFICATION_METRICS,
    GENERATION_METRICS,
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


class HarnessConfig(Section):
    """lm-evaluation-harness tasks the evaluate stage runs on the base and the fine-tuned model
    (lm-eval's Python API on the loaded models, in-process)."""

    tasks: list[str] = Field(
        default_factory=list,
        description="lm-eval task names (gsm8k, hellaswag, ...: the hub must be reachable for "
        "their data), or task YAML files / folders of them in the project (a local task: "
        "dataset_path json with data_files; data/harness/gsm8k_local.yaml is GSM8K's on the "
        "shipped rows). Empty: the harness does not run.")
    num_fewshot: int | None = Field(
        None, ge=0, description="Few-shot examples per prompt (None: each task's own).")
    limit: int | None = Field(
        None, gt=0, description="Evaluate only the first N documents of each task (None: all).")
    batch_size: int = Field(8, gt=0, description="Prompts per forward.")
    apply_chat_template: bool = Field(
        False, description="Render prompts with the exported tokenizer's chat template (the "
        "one a chat dataset trained with).")
    max_gen_toks: int | None = Field(
        None, gt=0, description="Cap on generated tokens per prompt (lm-eval's gen_kwargs "
        "max_gen_toks; None: each task's own).")
    models: list[Literal["base", "finetuned"]] = Field(
        default_factory=lambda: ["base", "finetuned"], min_length=1,
        description="Which models the tasks run on.")


class EvalConfig(Section):
    """Held-out loss during training; loss, perplexity and generation metrics in evaluate."""

    eval_strategy: Literal["no", "steps", "epoch"] = Field(
        "no", description="Eval during training: every eval_steps, at each epoch end, never."
    )
    eval_steps: int = Field(
        50, ge=0, description="Eval every N steps when eval_strategy=steps; 0: no step evals "
        "(0 disables, as in Forgather and QEfficient; the final step still evaluates).")
    eval_delay: float = Field(
        0, ge=0,
        description="No evaluation before this many steps (eval_strategy steps) or epochs "
        "(epoch), HF's rule: an evaluation is due when eval_delay <= step (or epoch).",
    )
    eval_batches: int | None = Field(
        None, ge=0, description="Batches of the test split each in-training evaluation reads "
        "(None or -1: all of them, max_eval_steps' -1; 0: no in-training evaluation at all, "
        "eval_on_save's included; > 0 with no eval_strategy in the file turns it on, every "
        "eval_steps). The evaluate stage always reads the whole split. Alias: max_eval_steps.",
        validation_alias=AliasChoices("eval_batches", "max_eval_steps"),
    )
    eval_on_save: bool = Field(
        False, description="Also evaluate at every checkpoint (so each one has a metric)."
    )
    early_stopping_patience: int | None = Field(
        None, gt=0,
        description="Stop after N evaluations in a row without improving "
        "checkpoint.metric_for_best_model by more than early_stopping_threshold.",
    )
    early_stopping_threshold: float = Field(
        0.0, ge=0, description="Minimum improvement that resets the patience counter."
    )
    generation_metrics: list[Literal[GENERATION_METRICS]] = Field(
        default_factory=list,
        description="Metrics on greedy generations in the evaluate stage: exact_match (final "
        "answer, GSM8K-style), rouge (ROUGE-1/2/L F1, rouge-score package), tool_calls (chat "
        "rows: tool_name_match and tool_arguments_match on each held-out turn that calls "
        "tools).",
    )
    max_generation_samples: int | None = Field(
        100, gt=0, description="Test rows generated for the metrics (None: the whole split)."
    )
    generation_max_new_tokens: int = Field(
        128, gt=0, description="Greedy generation length cap (stops earlier at EOS)."
    )
    num_logged_samples: int = Field(
        5, ge=0, description="Rows of prompt / reference / generation in the samples table."
    )
    answer_regex: str = Field(
        r"####\s*(.+)",
        description="exact_match: the answer is this regex's group 1 (first match); without "
        "a match, the last number in the text.",
    )
    bootstrap_samples: int = Field(
        1000, ge=0, fingerprint=False,
        description="The evaluate stage's standard errors of its own held-out metrics (loss, "
        "perplexity, exact match and the other means over rows, a classifier's accuracy, "
        "preference pair accuracy): the std of the metric over this many resamples of the "
        "held-out rows with replacement, seeded by training.seed; reported as "
        "<metric>_stderr beside each metric, so registry guards and "
        "min_improvement_stderr can judge them in standard errors. 0: no stderrs.",
    )
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    contamination_ngram: int | None = Field(
        13, ge=1, description="The evaluate stage's contamination check: the word n-gram "
        "length (lm-eval's decontamination convention: 13) whose overlap between the training "
        "rows and each evaluation set (the held-out split, every harness task) marks an "
        "evaluation row as contaminated; None: no check.",
    )

    @field_validator("eval_batches", mode="before")
    @classmethod
    def _no_cap(cls, value):
        return None if isinstance(value, int) and value == -1 else value

    @model_validator(mode="after")
    def _batches_turn_evaluation_on(self) -> "EvalConfig":
        """QEfficient's max_eval_steps > 0 is what turns in-training evaluation on: with no
        eval_strategy in the file, eval_batches > 0 means every eval_steps (an explicit
        eval_strategy, `no` included, wins)."""
        if self.eval_batches and "eval_strategy" not in self.model_fields_set:
            self.__dict__["eval_strategy"] = "steps"  # derived: not marked as set
        return self

    @property
    def evaluates_in_training(self) -> bool:
        """False at eval_batches 0: no in-training evaluation at all (not on a step, an epoch
        end, a save with eval_on_save, nor a callback's request)."""
        return self.eval_batches != 0

    @property
    def effective_eval_strategy(self) -> str:
        """eval_strategy with "0 disables" applied (eval_batches 0: no evals)."""
        return self.eval_strategy if self.evaluates_in_training else "no"

    @field_validator("answer_regex")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as exc:
            raise ValueError(f"not a valid regular expression ({exc})") from None
        if groups < 1:
            raise ValueError("needs one capture group: the answer is group 1")
        return pattern

    @property
    def wants_generation(self) -> bool:
        return bool(self.generation_metrics) or self.num_logged_samples > 0


#: export.formats unless set: every format, each written when it applies (tasks/exporters)
EXPORT_FORMATS = ("hf", "adapter", "quantized", "gguf")


class ExportConfig(Section):
    """What the export stage writes."""

    merge_adapter: bool = Field(True, description="Fold the adapter into the base weights.")
    save_adapter: bool = Field(
        True, description="Also write the adapter alone to <export>/adapter (PEFT runs)."
    )
    max_shard_size: str = Field("2GB", description="safetensors shard size.")
    formats: list[str] = Field(
        default_factory=lambda: list(EXPORT_FORMATS),
        description="What the export stage writes (tasks/exporters), each when it applies to "
        "the run: hf, the self-contained HF folder at the export root (always listed: the model "
        "card is in it, the other formats' folders too, and the registry logs its model); "
        "adapter, the PEFT adapter alone in <export>/adapter (PEFT runs with merge_adapter and "
        "save_adapter); quantized, the QAT model converted, in <export>/quantized (runs with "
        "training.qat_recipe); gguf, llama.cpp's files in <export>/gguf (when export.gguf "
        "lists types). Written hf first, whatever the list's order.")
    gguf: list[str] = Field(
        default_factory=list,
        description="GGUF file types the export stage writes to <export>/gguf (f32, f16, "
        "bf16, q8_0, q6_k, q5_k_m, q5_k_s, q4_k_m, q4_k_s: tasks/exporters/gguf/quants.py), "
        "the adapter merged, one file each, "
        "with an Ollama Modelfile and, for LoRA runs with save_adapter, the adapter alone as "
        "a LoRA-GGUF (docs/gguf.md). Empty: none.")

    @field_validator("formats")
    @classmethod
    def _hf_once(cls, formats: list[str]) -> list[str]:
        if "hf" not in formats:
            raise ValueError("list hf: the HF folder holds the model card and the other "
                             "formats' folders, and the registry logs its model")
        twice = [f for i, f in enumerate(formats) if f in formats[:i]]
        if twice:
            raise ValueError(f"'{twice[0]}' is listed twice")
        return formats

    @field_validator("gguf")
    @classmethod
    def _gguf_once(cls, types: list[str]) -> list[str]:
        """Names are checked against the encoders (tasks/exporters/gguf/quants.py) by
        `finetune validate` and the export stage; a name twice would write one file twice."""
        twice = [t for i, t in enumerate(types) if t in types[:i]]
        if twice:
            raise ValueError(f"'{twice[0]}' is listed twice")
        return types


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
        "eval.loss", description="Metric of the fine-tuned model that decides promotion: "
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
