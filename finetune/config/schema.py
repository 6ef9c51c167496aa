"""The typed config: the single source of truth for every params file.

Each section mirrors the code that consumes it (litgpt style): `model` feeds model loading,
`peft` the adapter, `data` the download/format/tokenize stages, `training`/`optimizer`/`scheduler`
the loop, and so on. Field names follow HF TrainingArguments where the concept overlaps, so a
user of Trainer/TRL/Axolotl recognises them. Unknown keys are errors (never silently ignored);
a value that names a feature not built yet is rejected with "not supported yet".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from finetune.config import compat, reads
from finetune.config.data import DataConfig
from finetune.config.distributed import DistributedConfig, torch_optimizer_name
from finetune.config.outputs import EvalConfig, ExportConfig, RegistryConfig
from finetune.config.reporting import LoggingConfig
from finetune.config.section import Section, did_you_mean
from finetune.config.training import TrainingConfig

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
)


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token", "additional_special_tokens")


class ModelConfig(Section):
    """What to load and how (`from_pretrained` arguments)."""

    name_or_path: str = Field(
        "data/models/stories260K",
        description="Hub model id or local folder (relative paths resolve against the project root).",
    )
    auto_class_name: str = Field(
        "AutoModelForCausalLM",
        description="Class that loads the model: a transformers AutoModel name, a key "
        "registered with engine.model.register_model_class, or 'module:Class'.",
        pattern=r"^[A-Za-z_][\w.\-]*(:[A-Za-z_]\w*)?$",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to pin.")
    model_init: str | None = Field(
        None,
        description="'module:function' with no arguments returning the base model (a "
        "transformers PreTrainedModel), used instead of from_pretrained (HF Trainer's model_init, without the trial argument); it runs "
        "after the seed is set, so the same params build the same model in every stage. The "
        "tokenizer still comes from name_or_path (or tokenizer_name_or_path).",
    )
    tokenizer_name_or_path: str | None = Field(
        None, validation_alias=AliasChoices("tokenizer_name_or_path", "tokenizer_name"),
        description="A tokenizer other than the model's (hub id or local folder); None: the "
        "model's. Alias: tokenizer_name, also as data.tokenizer_name (QEfficient's place for it). Saved "
        "with the trained and exported model.",
    )
    added_tokens: list[str] = Field(
        default_factory=list,
        description="New tokens added to the vocabulary (tokenizer.add_tokens); the embeddings "
        "grow to match (new rows: the mean of the old ones) and, with an adapter, the "
        "embedding and output layers train in full (modules_to_save).",
    )
    special_tokens: dict[str, str | list[str]] = Field(
        default_factory=dict,
        description="Special tokens to set or add (tokenizer.add_special_tokens): pad_token, "
        "eos_token, bos_token, unk_token, sep_token, cls_token, mask_token, "
        "additional_special_tokens (a list). A new token grows the vocabulary as added_tokens "
        "does.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype the weights are loaded in."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained."
    )
    use_cache: bool = Field(False, description="KV cache during training (off: saves memory).")
    device_map: str | None = Field(None, description="device_map for from_pretrained (e.g. 'cpu').")
    load_in_4bit: bool = Field(False, description="QLoRA 4-bit loading via bitsandbytes (CUDA only).")
    load_in_8bit: bool = Field(False, description="8-bit loading via bitsandbytes (CUDA only).")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub repo to run.")

    @field_validator("special_tokens")
    @classmethod
    def _known_special_tokens(cls, tokens: dict) -> dict:
        for key, value in tokens.items():
            if key not in SPECIAL_TOKEN_KEYS:
                raise ValueError(f"'{key}' is not a special token name (one of "
                                 f"{', '.join(SPECIAL_TOKEN_KEYS)})")
            if (key == "additional_special_tokens") != isinstance(value, list):
                raise ValueError(f"{key}: " + ("a list of tokens" if isinstance(value, str)
                                               else "one token (a string)"))
        return tokens

    @model_validator(mode="after")
    def _compat(self) -> "ModelConfig":
        compat.check(self, "model")
        return self


class PeftSection(Section):
    """Parameter-efficient fine-tuning (peft.LoraConfig / peft.IA3Config names)."""

    use_peft: bool = Field(True, description="Train an adapter; false = full fine-tuning.")
    peft_type: Literal["LORA", "IA3"] = Field("LORA", description="Adapter kind.")
    r: int = Field(8, gt=0, description="LoRA rank.")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator (alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'."
    )
    feedforward_modules: list[str] | None = Field(
        None, description="IA3 only: which target modules are feed-forward layers."
    )
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases train.")
    task_type: Literal["CAUSAL_LM", "SEQ_CLS"] = Field(
        "CAUSAL_LM", description="peft task type (SEQ_CLS, set for data.dataset_type "
        "classification, also trains the classification head: modules_to_save).")


class OptimizerConfig(Section):
    """Any torch.optim class by name plus its keyword arguments."""

    name: str = Field(
        "AdamW", description="torch.optim class name (AdamW, Adam, SGD, ...), or 'module:Class' "
        "for another torch.optim.Optimizer (e.g. bitsandbytes.optim:AdamW8bit, or yours).")
    learning_rate: float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra optimizer kwargs.")
    optimizer_groups: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Regex on parameter names -> that group's overrides (e.g. "
        "'norm|bias|embed': {weight_decay: 0.0}); first match wins, the rest use the values "
        "above; a regex left with no parameter is an error.",
    )
    log_param_groups: bool = Field(
        False, description="Print which parameters each optimizer group got."
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
        "cosine", description="Schedule (HF lr_scheduler_type: " + ", ".join(SCHEDULERS) + "), "
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
    warmup_steps: int = Field(0, ge=0, description="Warmup steps (exclusive with warmup_ratio).")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Warmup as a fraction of steps.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="scheduler_specific_kwargs (e.g. num_cycles, power)."
    )

    @model_validator(mode="after")
    def _compat(self) -> "SchedulerConfig":
        compat.check(self, "scheduler")
        return self


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
        "(e.g. training.max_steps to train past the planned end; train_data, base_model).",
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
    metric_for_best_model: Literal["eval_loss", "eval_perplexity"] | None = Field(
        None, description="Metric that ranks checkpoints (best kept, best loaded at end)."
    )
    greater_is_better: bool | None = Field(
        None, description="Direction of metric_for_best_model (None: lower is better)."
    )
    load_best_model_at_end: bool = Field(
        False, description="Write the best checkpoint's weights as the trained model."
    )

    @property
    def effective_save_strategy(self) -> str:
        """save_strategy with "0 disables" applied (steps every 0: no)."""
        return "no" if self.save_strategy == "steps" and self.save_steps == 0 else (
            self.save_strategy)

    @property
    def higher_wins(self) -> bool:
        return bool(self.greater_is_better)


class FinetuneConfig(Section):
    """A whole params file."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    peft: PeftSection = Field(default_factory=PeftSection)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)

    @model_validator(mode="before")
    @classmethod
    def _seed_names(cls, raw):
        """QEfficient calls the data section `dataset:` and writes the tokenizer under
        it (`data.tokenizer_name`), which is the model section's tokenizer_name_or_path."""
        if isinstance(raw, dict) and "dataset" in raw:
            if "data" in raw:
                raise ValueError("the params file has both a data: and a dataset: section "
                                 "(dataset is QEfficient's name for data); keep one")
            raw = {("data" if k == "dataset" else k): v for k, v in raw.items()}
        if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
            return raw
        if "tokenizer_name" not in raw["data"]:
            return raw
        data = dict(raw["data"])
        name = data.pop("tokenizer_name")
        model = dict(raw.get("model") or {})
        current = model.get("tokenizer_name_or_path", model.get("tokenizer_name"))
        if current not in (None, name):
            raise ValueError(f"data.tokenizer_name {name!r} and model.tokenizer_name_or_path "
                             f"{current!r} differ; set one of them")
        model.pop("tokenizer_name", None)
        model["tokenizer_name_or_path"] = name
        return {**raw, "data": data, "model": model}

    @model_validator(mode="after")
    def _cross_section(self) -> "FinetuneConfig":
        self._derive_model_task()
        compat.check(self, "config")  # every rule across sections (finetune/config/compat.py)
        return self

    def _derive_model_task(self) -> None:
        """The dataset type decides the model (finetune.datatypes.ModelTask): its class and
        peft task follow from it unless the params file sets them (a conflicting choice is the
        table's to refuse)."""
        task = self.data.task
        for section_name, key, wanted in (("model", "auto_class_name", task.auto_class),
                                          ("peft", "task_type", task.peft_task_type)):
            section = getattr(self, section_name)
            if key not in section.model_fields_set and getattr(section, key) != wanted:
                setattr(section, key, wanted)
                section.model_fields_set.discard(key)  # still the derived default

    @property
    def total_steps_hint(self) -> int | None:
        """Total optimizer steps when known from the config alone (max_steps based)."""
        if self.distributed.strategy == "diloco":
            return self.distributed.diloco.inner_steps * self.distributed.diloco.diloco_loops
        return self.training.max_steps if self.training.max_steps > 0 else None


reads.register_root(FinetuneConfig)
