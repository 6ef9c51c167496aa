"""Stage 6, export: a self-contained HF folder (adapter merged) plus a model card.

The result loads with `AutoModelForCausalLM.from_pretrained(data/export)` and nothing else:
safetensors weights, tokenizer, generation config and a README that records the base model,
data hash, params and metrics.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml

from engine.model import load_tokenizer, load_trained, resolve_model_ref
from finetune.errors import PipelineError
from finetune.workspace import Workspace, atomic_dir
from tasks import tracking


def data_hash(ws: Workspace) -> str:
    """SHA-256 over the raw split files: the data identity recorded in card and MLflow."""
    h = hashlib.sha256()
    for path in sorted(ws.layout.raw.glob("*.parquet")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def export(ws: Workspace) -> dict[str, Path]:
    cfg = ws.config
    if not ws.layout.trained.exists():
        raise PipelineError(f"{ws.layout.trained} missing; run the train stage first")
    model = load_trained(cfg.model, cfg.peft, ws.root, ws.layout.trained)
    if cfg.peft.use_peft and cfg.export.merge_adapter:
        model = model.merge_and_unload()
    tok = load_tokenizer(cfg.model, ws.root)
    metrics_file = ws.layout.metrics / "eval.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    run_id = tracking.run_id_of(ws)
    digest = data_hash(ws)
    with atomic_dir(ws.layout.export) as staging:
        model.save_pretrained(staging, safe_serialization=True, max_shard_size=cfg.export.max_shard_size)
        tok.save_pretrained(staging)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        (staging / "README.md").write_text(model_card(ws, metrics, digest, run_id))
    if run_id:
        tracking.set_tags(ws, run_id, {"export_path": str(ws.layout.export), "data_sha256": digest,
                                       **tracking.dvc_lock_hashes(ws.root)})
        tracking.client(ws).log_artifact(run_id, str(ws.layout.export / "README.md"), "export")
        tracking.finish_run(ws, run_id)
    return {"export": ws.layout.export}


def model_card(ws: Workspace, metrics: dict, digest: str, run_id: str | None) -> str:
    cfg = ws.config
    git = tracking.git_info(ws.root)
    base = resolve_model_ref(cfg.model.name_or_path, ws.root)
    source = cfg.data.dataset_name or cfg.data.json_file_path or cfg.data.data_files
    rows = "\n".join(
        f"| {name} | {vals.get('loss')} | {vals.get('perplexity')} |"
        for name, vals in metrics.items() if isinstance(vals, dict)
    )
    return f"""---
library_name: transformers
base_model: {cfg.model.name_or_path}
pipeline_tag: text-generation
---
# Fine-tuned {Path(cfg.model.name_or_path).name}

Fine-tuned with {cfg.peft.peft_type if cfg.peft.use_peft else 'full'} fine-tuning
({'adapter merged' if cfg.peft.use_peft and cfg.export.merge_adapter else 'weights as trained'}).

- Base model: `{cfg.model.name_or_path}` (`{base}`)
- Data: `{source}`, raw splits sha256 `{digest}`
- Git commit: `{git['git_commit']}` (dirty: {git['git_dirty']})
- MLflow run: `{run_id}`

## Metrics (test split)
| model | loss | perplexity |
|---|---|---|
{rows}

## Load it
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{ws.layout.export.relative_to(ws.root)}")
tokenizer = AutoTokenizer.from_pretrained("{ws.layout.export.relative_to(ws.root)}")
```

## Params
```yaml
{yaml.safe_dump(cfg.model_dump(mode='json'), sort_keys=False)}```
"""
