"""The `eval` section: held-out loss during training, and what the evaluate stage measures on
the base and the fine-tuned model (generation metrics, lm-evaluation-harness tasks).

Its keys drive the evaluate stage (and in-training evaluation); dvc.yaml tracks them per
stage, so changing a generation setting never retrains.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from finetune.config.section import Section
from finetune.datatypes.metrics import GENERATION_METRICS


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
    early_stopping_threshold_stderr: float = Field(
        0.0, ge=0,
        description="Minimum improvement that resets the patience counter, in standard errors "
        "of the difference from the best (sqrt(se^2 + best_se^2), the bootstrap stderrs of a "
        "generation metric measured during training, as registry.min_improvement_stderr "
        "judges the gate); both thresholds must be met. Needs a metric_for_best_model that "
        "is a generation metric (eval.during_training_metrics) and eval.bootstrap_samples > "
        "0. 0: off.",
    )
    during_training_metrics: bool | list[str] = Field(
        False,
        description="At every in-training evaluation, also greedy-generate on a seeded subset "
        "of the evaluate stage's generation rows with the current weights and score them as "
        "the evaluate stage does (eval.generation_metrics, with bootstrap stderrs): logged as "
        "eval_<metric> and eval_<metric>_stderr (eval_exact_match, eval_rouge1, "
        "eval_tool_name_match, ...), so checkpoint.metric_for_best_model and early stopping "
        "may name them. true: every metric eval.generation_metrics reports; a list: those "
        "named (exact_match, rouge1, tool_name_match, ...; rouge and tool_calls name their "
        "group), and lm-eval harness metrics as the evaluate stage's eval.json spells them, "
        "harness.<task>.<metric>.<filter> of a task eval.harness.tasks lists (run with "
        "eval.harness's settings and limit eval.during_training_samples, logged as "
        "eval_harness.<task>.<metric>.<filter> with its _stderr; single or ddp only: under "
        "DDP rank 0 runs it and broadcasts the numbers). Rewards and pass@k of a rollout "
        "method are the evaluate stage's only (refused here; a rollout method logs "
        "eval_reward during training on its own). Costs one generation pass per evaluation "
        "(eval_seconds).",
    )
    during_training_samples: int = Field(
        32, gt=0,
        description="The generation rows each in-training evaluation scores (with "
        "during_training_metrics): the first N of a permutation of the evaluate stage's rows "
        "(its first max_generation_samples) seeded by training.seed, the same rows at every "
        "evaluation; N >= max_generation_samples: exactly the evaluate stage's rows. Split "
        "across ranks (rank r: rows r, r + world, ...).",
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
