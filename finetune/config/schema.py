"""The typed config: the single source of truth for every params file.

Each section mirrors the code that consumes it (litgpt style) and lives in its own module:
`model`/`peft` (finetune/config/model.py) feed model loading and the adapter, `data` the
download/format/tokenize stages, `training`/`optimizer`/`scheduler` the loop, and so on. This
module only assembles them into the whole file and runs the rules across sections. Field names
follow HF TrainingArguments where the concept overlaps, so a user of Trainer/TRL/Axolotl
recognises them. Unknown keys are errors (never silently ignored).
"""

from __future__ import annotations

from pydantic import model_validator

from finetune.config import compat, deepspeed, fingerprint, reads
from finetune.config.checkpoint import CheckpointConfig
from finetune.config.data import DataConfig
from finetune.config.distill import DistillConfig
from finetune.config.distributed import DistributedConfig
from finetune.config.evaluation import EvalConfig
from finetune.config.export import ExportConfig
from finetune.config.grpo import GRPOConfig
from finetune.config.kto import KTOConfig
from finetune.config.methods import method_of
from finetune.config.model import ModelConfig, PeftSection
from finetune.config.optim import OptimizerConfig, SchedulerConfig
from finetune.config.preference import DPOConfig
from finetune.config.registry import RegistryConfig
from finetune.config.reporting import LoggingConfig
from finetune.config.reward import RewardConfig
from finetune.config.rloo import RLOOConfig
from finetune.config.section import Field, Section
from finetune.config.training import TrainingConfig

#: the sections, importable from here as before (each is defined in its own module)
__all__ = ["FinetuneConfig", "ModelConfig", "PeftSection", "DataConfig", "TrainingConfig",
           "OptimizerConfig", "SchedulerConfig", "DistributedConfig", "CheckpointConfig",
           "EvalConfig", "LoggingConfig", "ExportConfig", "RegistryConfig", "DPOConfig",
           "GRPOConfig", "RLOOConfig", "RewardConfig", "DistillConfig"]


class FinetuneConfig(Section):
    """A whole params file."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    peft: PeftSection = Field(default_factory=PeftSection)
    # the train examples are identified by their content hash (max_seq_length is kept)
    data: DataConfig = Field(default_factory=DataConfig, fingerprint=False)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    # bookkeeping: when to log, save and evaluate, what to export and register
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, fingerprint=False)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    rloo: RLOOConfig = Field(default_factory=RLOOConfig)
    kto: KTOConfig = Field(default_factory=KTOConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig, fingerprint=False)
    logging: LoggingConfig = Field(default_factory=LoggingConfig, fingerprint=False)
    export: ExportConfig = Field(default_factory=ExportConfig, fingerprint=False)
    registry: RegistryConfig = Field(default_factory=RegistryConfig, fingerprint=False)

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

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_keys(cls, raw):
        """training.deepspeed_config's keys set as ours (finetune/config/deepspeed.py)."""
        return deepspeed.apply(raw) if isinstance(raw, dict) else raw

    @model_validator(mode="after")
    def _cross_section(self) -> "FinetuneConfig":
        self._derive_model_task()
        self._derive_gate_metric()
        compat.check(self, "config")  # every rule across sections (finetune/config/compat.py)
        return self

    @property
    def model_task(self):
        """The model this run trains (finetune.datatypes.ModelTask): the trainer type's when it
        sets one (finetune.config.methods), else the dataset type's."""
        from finetune.config.methods import method_of

        return method_of(self.training.type).task or self.data.task

    def _derive_model_task(self) -> None:
        """The model task decides the model (`model_task`): its class and peft task follow
        from it unless the params file sets them (a conflicting choice is the table's to
        refuse)."""
        task = self.model_task
        for section_name, key, wanted in (("model", "auto_class_name", task.auto_class),
                                          ("peft", "task_type", task.peft_task_type)):
            section = getattr(self, section_name)
            if key not in section.model_fields_set and getattr(section, key) != wanted:
                setattr(section, key, wanted)
                section.model_fields_set.discard(key)  # still the derived default

    def _derive_gate_metric(self) -> None:
        """registry.gate_metric, where the params file names none, is the method's own (a
        GRPO run reports no eval.loss to gate on: finetune.config.methods.Method.default_gate),
        so a method's run needs no registry section to validate."""
        from finetune.config.methods import method_of

        registry, gate = self.registry, method_of(self.training.type).default_gate
        if gate and "gate_metric" not in registry.model_fields_set:
            registry.gate_metric = gate
            registry.model_fields_set.discard("gate_metric")  # still the derived default

    @property
    def total_steps_hint(self) -> int | None:
        """Total optimizer steps when known from the config alone (max_steps based)."""
        if self.distributed.strategy == "diloco":
            return self.distributed.diloco.inner_steps * self.distributed.diloco.diloco_loops
        return self.training.max_steps if self.training.max_steps > 0 else None


reads.register_root(FinetuneConfig)
fingerprint.register_root(FinetuneConfig)  # which keys count, from the fields' facts


# -- the row between the method and the data (finetune/config/compat.py), at the root --------


def _pairs_and_trainer(c) -> str | None:
    """Each source's rows are ones the trainer type trains on (finetune.config.methods: preference
    pairs train with dpo, and dpo trains on nothing else)."""
    method = method_of(c.training.type)
    return next(filter(None, (method.refusal(d.datatype) for _, d in c.data.parts())), None)


compat.add_rows("config", [
    compat.Agree("config", ("training.type", "data.dataset_type"), _pairs_and_trainer,
                 example={"training.type": "dpo"}),
])
