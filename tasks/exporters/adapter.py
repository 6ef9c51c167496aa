"""`adapter`: the PEFT adapter alone in `<export>/adapter`, for users who keep the base model.

Written for PEFT runs whose HF folder has the adapter merged (export.merge_adapter) when
export.save_adapter is true; unmerged, the HF folder is the adapter already.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from finetune.config import FinetuneConfig
from tasks.exporters.base import Exporter
from tasks.exporters.context import ExportContext

ADAPTER_DIR = "adapter"


def applies(cfg: FinetuneConfig) -> bool:
    return cfg.peft.use_peft and cfg.export.merge_adapter and cfg.export.save_adapter


def write(ctx: ExportContext) -> Path | None:
    if not applies(ctx.config):
        return None
    # the train stage's folder as it is: adapter weights and config, the tokenizer, its card
    return Path(shutil.copytree(ctx.ws.layout.trained, ctx.staging / ADAPTER_DIR))


class AdapterExporter(Exporter):
    name = "adapter"

    def write(self, ctx: ExportContext) -> Path | None:
        return write(ctx)

    def card_section(self, ctx: ExportContext, export_dir: Path) -> str:
        """How to load the adapter alone, where it was written."""
        if not applies(ctx.config):
            return ""
        auto = ctx.config.model_task.auto_class.removeprefix("Auto")
        return f"""
The adapter alone (for users who keep the base model) is in `{ADAPTER_DIR}/`:
```python
from peft import AutoPeft{auto}
model = AutoPeft{auto}.from_pretrained("{export_dir}/{ADAPTER_DIR}")
```
"""
