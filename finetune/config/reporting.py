"""The `logging` section: what a run reports, where, and which callbacks it runs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from finetune.config import compat
from finetune.config.section import Section


class ProfilerConfig(Section):
    """torch.profiler over a few optimizer steps (torchtune's `profiler` names): where a step's
    time goes, op by op, on the device and the host. Off by default; it changes no number a
    run computes, so it is outside the checkpoint fingerprint."""

    enabled: bool = Field(False, description="Trace optimizer steps with torch.profiler.")
    wait_steps: int = Field(
        1, ge=0, description="Steps to skip first (each cycle): compilation and allocator "
        "warm-up are not what a step costs.")
    warmup_steps: int = Field(
        1, ge=0, description="Steps traced but thrown away before the recorded ones (each "
        "cycle): the profiler's own start-up cost.")
    active_steps: int = Field(2, ge=1, description="Steps recorded per cycle.")
    num_cycles: int = Field(1, ge=1, description="How many wait/warmup/active cycles.")
    record_shapes: bool = Field(False, description="Record each op's input shapes.")
    profile_memory: bool = Field(False, description="Record tensor allocations and frees.")
    with_stack: bool = Field(False, description="Record Python stacks (larger traces).")
    with_flops: bool = Field(
        False, description="Estimate the FLOPs of matmuls and convolutions (the ops table's "
        "FLOPs column).")
    row_limit: int = Field(
        25, ge=1, description="Rows of the ops table written beside each trace.")
    output_dir: str | None = Field(
        None, description="Where the traces go (None: logging_dir/profile): one Chrome/"
        "Perfetto trace (trace-...-rankR.json) and one ops table (ops-...-rankR.txt) per "
        "rank and cycle, named by the steps they cover; an existing file is never "
        "overwritten. Not inside the trained model's or the checkpoints' folder (every run "
        "rewrites those).")

    @model_validator(mode="after")
    def _compat(self) -> "ProfilerConfig":
        compat.check(self, "logging.profiler")
        return self


class LoggingConfig(Section):
    """Where metrics go: stdout, MLflow (SQLite in the project by default), DVC plots."""

    logging_steps: int = Field(
        10, ge=0, description="Log every N optimizer steps; 0: no periodic rows, "
        "only the final step's, which carries the run's train_loss.")
    logging_first_step: bool = Field(True, description="Also log step 1.")
    logging_strategy: Literal["no", "steps", "epoch"] = Field(
        "steps",
        description="When a training row is logged: every logging_steps, at each epoch end, or "
        "no periodic rows (the final step's row, which carries train_loss, is always logged).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="Our [train] lines and metric rows print at info; warning or error keeps "
        "them off stdout (the files and trackers still get every row). transformers' "
        "verbosity follows at debug (its info), warning and error.",
    )
    log_on_each_node: bool = Field(
        True,
        description="Multi-node runs: each node's local rank 0 also prints the logged rows "
        "on its own stdout, prefixed [train node N] (HF's name and default); false: node 0 "
        "alone. Files and trackers are written by node 0 either way.",
    )
    run_name: str | None = Field(
        None, description="The MLflow run's name (None: MLflow draws one)."
    )
    report_to: list[Literal["mlflow", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["mlflow", "jsonl"],
        validation_alias=AliasChoices("report_to", "log_with"),
        description="Reporters besides stdout and the DVC plots CSVs (always on); one name or "
        "a list, 'none' for none (alias log_with, Accelerate's name). wandb: the W&B run gets "
        "every row through the stage's relay, as MLflow does; W&B's environment applies "
        "(WANDB_MODE=offline writes it under logging_dir/wandb without network).",
    )
    wandb_project: str | None = Field(
        None, description="The W&B project (None: experiment_name)."
    )
    logging_dir: str = Field(
        "data/logs", description="Where jsonl (train_log.jsonl) and tensorboard logs go."
    )
    disable_tqdm: bool | None = Field(
        None, description="Progress bar off (true) / on (false); None: on only on a terminal."
    )
    progress_bar: Literal["tqdm", "rich"] = Field("tqdm", description="Progress bar library.")
    callbacks: list[str | dict[str, Any]] = Field(
        default_factory=list,
        description="Your callbacks: 'module:Class', or {class: 'module:Class', kwargs: {...}} "
        "(see engine/reporting/callbacks.py for the hooks and the control object).",
    )
    restore_callback_states_from_checkpoint: bool = Field(
        False,
        description="On resume, give callbacks with load_state_dict the state they had in the "
        "checkpoint (HF's name); their states are saved in every checkpoint either way.",
    )
    include_num_input_tokens_seen: bool = Field(
        True, description="Count and log input tokens seen (num_input_tokens_seen)."
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow store; default sqlite:///<project>/mlflow.db."
    )
    experiment_name: str = Field("finetune", description="MLflow experiment.")
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_or_none(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [] if value == "none" else [value]
        return value

    @field_validator("callbacks")
    @classmethod
    def _callback_specs(cls, specs: list) -> list:
        return [_check_callback_spec(s) for s in specs]


def _check_callback_spec(spec: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(spec, dict):
        unknown = set(spec) - {"class", "kwargs"}
        if "class" not in spec or unknown or not isinstance(spec.get("kwargs", {}), dict):
            raise ValueError("a callback mapping is {class: 'module:Class', kwargs: {...}} "
                             f"(got keys {sorted(spec)})")
    return spec
