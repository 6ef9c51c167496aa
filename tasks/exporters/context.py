"""What every exporter is handed: the run, the models and the folder being written."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from finetune.config import FinetuneConfig
from finetune.workspace import Workspace


@dataclass
class ExportContext:
    """One export: loaded once by the export stage, read by each format's `write`.

    `staging` is the export folder being built (finetune.files.atomic_dir moves it into place
    when every format is written); an exporter writes there and nowhere else.
    """

    ws: Workspace
    model: Any  #: as trained: a PEFT model for peft.use_peft runs
    tokenizer: Any
    metrics: dict  #: data/metrics/eval.json, or {} before the evaluate stage ran
    lineage: dict[str, str]
    run_id: str | None  #: the training's MLflow run, None without one
    staging: Path
    formats: tuple[str, ...]  #: export.formats, as listed

    @property
    def config(self) -> FinetuneConfig:
        return self.ws.config

    @property
    def merged(self) -> bool:
        """The adapter is folded into the weights the HF folder holds."""
        return self.config.peft.use_peft and self.config.export.merge_adapter

    @cached_property
    def hf_model(self):
        """The model the HF folder holds: the adapter merged when `merged`, else the model as
        trained (a PEFT run's adapter, unmerged). Computed once, on first use."""
        return self.model.merge_and_unload() if self.merged else self.model

    @cached_property
    def servable(self):
        """A plain transformers model (what the registry logs): the HF folder's, or for an
        unmerged PEFT run the adapter merged now."""
        if self.merged or not self.config.peft.use_peft:
            return self.hf_model
        return self.model.merge_and_unload()
