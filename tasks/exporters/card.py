"""The model card (README.md of the HF folder): base model, data hash, params, metrics, and how
to load what the export holds. Only what the params, code and data determine: the export is a
DVC out, so the same run must write the same bytes; the git commit and MLflow run id, which
differ per commit and per run, are tags of the registered version and of the run."""

from __future__ import annotations

from pathlib import Path

import yaml

from engine.export import resolve_model_ref
from finetune.config import FinetuneConfig
from finetune.config.export import EXPORT_FORMATS
from tasks.exporters import resolve
from tasks.exporters.context import ExportContext

#: the params the model card records: what made the model and its export. dvc.yaml lists each
#: of them for the export stage, so a change to any of them rewrites the card.
CARD_SECTIONS = ("model", "peft", "data", "training", "optimizer", "scheduler", "distributed",
                 "export", "registry")


def _metrics_table(metrics: dict) -> str:
    models = {k: v for k, v in metrics.items() if isinstance(v, dict)}
    columns = sorted({c for vals in models.values() for c in vals},
                     key=lambda c: (c not in ("loss", "perplexity"), c))
    head = "| model | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns)
    rows = [f"| {name} | " + " | ".join(str(vals.get(c, "")) for c in columns) + " |"
            for name, vals in models.items()]
    return "\n".join([head, *rows])


def model_card(ctx: ExportContext) -> str:
    ws, cfg, lineage = ctx.ws, ctx.config, ctx.lineage
    base = resolve_model_ref(cfg.model.name_or_path, ws.root)
    if Path(base).is_relative_to(ws.root):  # a folder of the project: no clone's own path
        base = Path(base).relative_to(ws.root).as_posix()
    if cfg.model.gguf_file:  # the base weights came from that file
        base = f"{base}, GGUF file {cfg.model.gguf_file}"
    source = cfg.data.dataset_name or cfg.data.json_file_path or cfg.data.data_files
    export_dir = ws.layout.export.relative_to(ws.root)
    auto, tag = cfg.model_task.auto_class, cfg.model_task.pipeline_tag
    # each listed format's part, in the order they are written (tasks/exporters)
    section = "".join(e.card_section(ctx, export_dir) for e in resolve(ctx.formats))
    return f"""---
library_name: transformers
base_model: {cfg.model.name_or_path}
pipeline_tag: {tag}
---
# Fine-tuned {Path(cfg.model.name_or_path).name}

Fine-tuned with {cfg.peft.peft_type if cfg.peft.use_peft else 'full'} fine-tuning
({'adapter merged' if ctx.merged else 'weights as trained'}).

- Base model: `{cfg.model.name_or_path}` (`{base}`)
- Data: `{source}`, raw splits sha256 `{lineage.get('data_sha256')}`
- Config fingerprint: `{lineage.get('config_fingerprint')}`
- Strategy: {cfg.distributed.strategy}, world size {cfg.distributed.world_size}
- Git commit and MLflow run: the tags of the registered model version and of its MLflow run

## Metrics (test split)
{_metrics_table(ctx.metrics)}

## Load it
```python
from transformers import {auto}, AutoTokenizer
model = {auto}.from_pretrained("{export_dir}")
tokenizer = AutoTokenizer.from_pretrained("{export_dir}")
```
{section}
## Params
```yaml
{yaml.safe_dump(_card_params(cfg), sort_keys=False)}```
"""


def _card_params(cfg: FinetuneConfig) -> dict:
    """CARD_SECTIONS as set; export.formats only when it is not the default (every format,
    each when it applies) and export.gguf only when it lists types, so a default export's card
    is what it was before these keys existed."""
    unset = ({"formats"} if list(EXPORT_FORMATS) == cfg.export.formats else set()) | (
        set() if cfg.export.gguf else {"gguf"})
    return cfg.model_dump(mode="json", include=set(CARD_SECTIONS),
                          exclude={"export": unset} if unset else None)
