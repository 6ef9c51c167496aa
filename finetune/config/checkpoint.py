"""The `checkpoint` section: when checkpoints are written, which are kept, and whether (and
from which) a run resumes. engine/state/checkpoint.py and engine/state/trainer_state.py consume it.
"""

from __future__ import annotations

from typing import Literal

import re

from pydantic import Field, field_validator

from finetune.config.section import Section


#: what checkpoint.metric_for_best_model may look like (which ones a run reports: the
#: compatibility table, finetune/config/compat.py)
EVAL_METRIC = re.compile(r"eval_[A-Za-z0-9_]+|eval_harness\.[^.\s]+\.[^.\s]+\.[^.\s]+")
#: the in-training metrics that are better lower
LOWER_IS_BETTER = ("eval_loss", "eval_perplexity")


class CheckpointConfig(Section):
    """Periodic training state for resume (model/adapter, optimizer, scheduler, RNG, data),
    and which checkpoints are worth keeping (HF TrainingArguments names)."""

    save_strategy: Literal["no", "steps", "epoch"] = Field(
        "steps", description="When to checkpoint: every save_steps, at each epoch end, never."
    )
    save_steps: int = Field(
        50, ge=0, description="Checkpoint every N optimizer steps; 0: no checkpoints at all "
        "(0 disables, as save_strategy no).")
    save_total_limit: int | None = Field(
        2, gt=0,
        description="Keep at most N checkpoints: the newest, plus the best by "
        "metric_for_best_model when set (else the newest N). With preserve_n_best: the newest "
        "N, and the best ones on top.",
    )
    preserve_n_best: int | None = Field(
        None, gt=0,
        description="Also keep the N best checkpoints by metric_for_best_model, apart from the "
        "newest save_total_limit (Forgather's name): a checkpoint stays while it is among either. "
        "Needs metric_for_best_model.",
    )
    resume_from_checkpoint: bool | Literal["auto"] | str = Field(
        False,
        description="Continue from the latest checkpoint: true refuses one written by another "
        "run (its fingerprint: docs, Reliability); auto resumes it only when it is this run's, "
        "else starts fresh (what an orchestrator retry uses); a path (a step-* folder, "
        "relative to the project) resumes that checkpoint, checked as true checks the latest, "
        "and moves the folder's later checkpoints aside.",
    )
    resume_ignore_changes: list[str] = Field(
        default_factory=list,
        description="Fingerprint keys allowed to differ on resume, as the refusal names them "
        "(e.g. training.max_steps to train past the planned end; train_data, base_model, "
        "user_code: an edited tool, environment or reward function).",
    )
    save_on_each_node: bool = Field(
        False,
        description="Multi-node runs without shared storage: each node's local rank 0 writes "
        "a whole checkpoint into its own checkpoint folder (its ranks save through a "
        "node-local process group) and a resume reads each node's own copy (HF's name). Needs "
        "state that every node holds whole (single, ddp, diloco without FSDP groups). The "
        "trained model and metrics are node 0's outputs either way.",
    )
    keep_previous_runs: int = Field(
        1, ge=0,
        description="A fresh run moves the checkpoints already in the folder to "
        "<checkpoints>.previous/<time>; keep this many such sets (0: delete them).",
    )
    metric_for_best_model: str | None = Field(
        None, description="Metric that ranks checkpoints (best kept, best loaded at end) and "
        "that early stopping watches: eval_loss, eval_perplexity, or with "
        "eval.during_training_metrics a generation metric the evaluate stage reports for "
        "eval.generation_metrics, as eval_<metric> (eval_exact_match, eval_rouge1, "
        "eval_rouge2, eval_rougeL, eval_tool_name_match, eval_tool_arguments_match); a "
        "rollout method (grpo, rloo): eval_reward, its greedy reward on eval.eval_batches; "
        "an lm-eval harness metric that eval.during_training_metrics names, as "
        "eval_harness.<task>.<metric>.<filter>."
    )
    greater_is_better: bool | None = Field(
        None, description="Direction of metric_for_best_model (None: from the metric, as HF "
        "does: eval_loss and eval_perplexity lower is better, the generation metrics "
        "higher; a harness metric as registry.gate_metric's: loss, perplexity and "
        "bits_per_byte lower). An explicit value is used as given, also against the "
        "metric's direction.")
    load_best_model_at_end: bool = Field(
        False, description="Write the best checkpoint's weights as the trained model."
    )

    @property
    def effective_save_strategy(self) -> str:
        """save_strategy with "0 disables" applied (steps every 0: no)."""
        return "no" if self.save_strategy == "steps" and self.save_steps == 0 else (
            self.save_strategy)

    @field_validator("metric_for_best_model")
    @classmethod
    def _an_eval_metric(cls, name: str | None) -> str | None:
        if name is not None and not EVAL_METRIC.fullmatch(name):
            raise ValueError(f"'{name}' is not an in-training evaluation metric: eval_loss, "
                             "eval_perplexity, or eval_<metric> for a generation metric "
                             "(eval_exact_match, eval_rouge1, eval_tool_name_match, ...) or "
                             "eval_harness.<task>.<metric>.<filter>")
        return name

    @property
    def higher_wins(self) -> bool:
        """greater_is_better, or the metric's own direction when unset (HF: loss and
        perplexity lower, the rest higher)."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        metric = self.metric_for_best_model
        if metric is not None and metric.startswith("eval_harness."):
            from finetune.config.registry import higher_wins

            return higher_wins("eval." + metric.removeprefix("eval_"))
        return metric is not None and metric not in LOWER_IS_BETTER
