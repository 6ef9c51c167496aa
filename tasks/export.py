"""Stage 6, export: a self-contained HF folder, the adapter alone, a model card, a registry entry.

`data/export` loads with `AutoModelForCausalLM.from_pretrained` and nothing else: safetensors
weights (adapter merged), tokenizer, generation config and a README (model card) recording base
model, data hash, params, metrics and commit. `data/export/adapter` is the PEFT adapter alone,
for users who keep the base model. The merged model is then logged to the training's MLflow run
(transformers flavour), registered, tagged with lineage and gated (see tasks.registry).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from engine.modeling.labels import read_labels, write_labels
from engine.modeling.model import load_tokenizer, load_trained, resolve_model_ref
from engine.modeling.quantization import quantized_copy, save_quantized
from engine.process.distributed import choose_device
from finetune.config.compat import check_machine
from finetune.errors import PipelineError
from finetune.files import atomic_dir, write_json_atomic
from finetune.workspace import Workspace
from tasks import registry, tracking

ADAPTER_DIR = "adapter"
QUANTIZED_DIR = "quantized"  # training.qat_recipe: the converted model
#: the params the model card records: what made the model and its export. dvc.yaml lists each
#: of them for the export stage, so a change to any of them rewrites the card.
CARD_SECTIONS = ("model", "peft", "data", "training", "optimizer", "scheduler", "distributed",
                 "export", "registry")


def export(ws: Workspace) -> dict[str, Path]:
    cfg = ws.config
    check_machine(cfg, choose_device(cfg.training.resolved_device), sections=("model",))
    if not ws.layout.trained.exists():
        raise PipelineError(f"{ws.layout.trained} missing; run the train stage first")
    metrics_file = ws.layout.metrics / "eval.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    gate_value = _gate_value(ws, metrics)
    model = load_trained(cfg.model, cfg.peft, ws.root, ws.layout.trained)
    tok = load_tokenizer(cfg.model, ws.root)
    trained_template = ws.layout.trained / "chat_template.jinja"
    if trained_template.exists():  # a chat dataset's template, saved by the train stage
        tok.chat_template = trained_template.read_text()
    run_id = tracking.run_id_of(ws)
    lineage = tracking.lineage_tags(ws)
    merge = cfg.peft.use_peft and cfg.export.merge_adapter
    with atomic_dir(ws.layout.export) as staging:
        saved = model.merge_and_unload() if merge else model
        saved.save_pretrained(staging, safe_serialization=True,
                              max_shard_size=cfg.export.max_shard_size)
        tok.save_pretrained(staging)
        labels = read_labels(ws.layout.trained)
        if labels:  # also in config.json (id2label); the file is what our stages read
            write_labels(staging, labels)
        if getattr(saved, "generation_config", None) is not None:
            saved.generation_config.save_pretrained(staging)
        if cfg.peft.use_peft and cfg.export.save_adapter and merge:
            shutil.copytree(ws.layout.trained, staging / ADAPTER_DIR)
        (staging / "README.md").write_text(model_card(ws, metrics, lineage, run_id))
        t = cfg.training
        if t.qat_recipe:  # next to the normal folder: the QAT model, converted
            quantized, skipped = quantized_copy(saved if merge else model, t.qat_recipe,
                                                t.qat_group_size)
            save_quantized(quantized, staging / QUANTIZED_DIR, t.qat_recipe, t.qat_group_size,
                           skipped)
            del quantized
    record = {"registered": False, "reason": "registry.register_model is false"}
    if run_id:
        tracking.set_tags(ws, run_id, {"export_path": str(ws.layout.export), **lineage})
        tracking.client(ws).log_artifact(run_id, str(ws.layout.export / "README.md"), "export")
        if cfg.registry.register_model:
            servable = saved if not cfg.peft.use_peft or merge else model.merge_and_unload()
            record = _register(ws, run_id, servable, tok, gate_value, lineage)
        tracking.finish_run(ws, run_id)
    elif cfg.registry.register_model:
        record = {"registered": False, "reason": f"no MLflow run in {ws.layout.train_run}"}
    write_json_atomic(ws.layout.model_version, record)
    return {"export": ws.layout.export, "model_version": ws.layout.model_version}


def _gate_value(ws: Workspace, metrics: dict) -> float | None:
    """The new model's gate metric; None (never promoted) when evaluate has not produced it,
    e.g. `finetune stage export` run straight after train."""
    key = ws.config.registry.gate_metric.removeprefix("eval.")
    value = (metrics.get("finetuned") or {}).get(key)
    return None if value is None else float(value)


def _register(ws: Workspace, run_id: str, model, tok, gate_value: float | None,
              lineage: dict[str, str]) -> dict:
    cfg = ws.config
    fallback = cfg.logging.experiment_name  # read either way: dvc.yaml must list it
    name = cfg.registry.registered_model_name or fallback
    version = registry.log_and_register(ws.mlflow_uri(), run_id, model, tok, name,
                                        cfg.eval.generation_max_new_tokens,
                                        (ws.layout.export / "README.md").read_text(),
                                        pipeline_tag=cfg.model_task.pipeline_tag)
    client = tracking.client(ws)
    registry.tag_version(client, name, version, {**lineage, "mlflow_run_id": run_id})
    decision = registry.promote(client, name, version, gate_value, cfg.registry)
    aliases = [cfg.registry.candidate_alias] + ([cfg.registry.champion_alias]
                                                 if decision.promoted else [])
    print(f"[export] registered {name} v{version} as {' + '.join(aliases)}: {decision.reason}",
          flush=True)
    tracking.set_tags(ws, run_id, {"registered_model": f"{name}/{version}",
                                   "promoted": str(decision.promoted).lower()})
    return {**decision.as_dict(), "aliases": aliases,
            "model_uri": f"models:/{name}/{version}"}


def _metrics_table(metrics: dict) -> str:
    models = {k: v for k, v in metrics.items() if isinstance(v, dict)}
    columns = sorted({c for vals in models.values() for c in vals},
                     key=lambda c: (c not in ("loss", "perplexity"), c))
    head = "| model | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns)
    rows = [f"| {name} | " + " | ".join(str(vals.get(c, "")) for c in columns) + " |"
            for name, vals in models.items()]
    return "\n".join([head, *rows])


def model_card(ws: Workspace, metrics: dict, lineage: dict[str, str], run_id: str | None) -> str:
    cfg = ws.config
    base = resolve_model_ref(cfg.model.name_or_path, ws.root)
    source = cfg.data.dataset_name or cfg.data.json_file_path or cfg.data.data_files
    export_dir = ws.layout.export.relative_to(ws.root)
    merged = cfg.peft.use_peft and cfg.export.merge_adapter
    auto, tag = cfg.model_task.auto_class, cfg.model_task.pipeline_tag
    adapter = ""
    if merged and cfg.export.save_adapter:
        adapter = f"""
The adapter alone (for users who keep the base model) is in `{ADAPTER_DIR}/`:
```python
from peft import AutoPeft{auto.removeprefix("Auto")}
model = AutoPeft{auto.removeprefix("Auto")}.from_pretrained("{export_dir}/{ADAPTER_DIR}")
```
"""
    return f"""---
library_name: transformers
base_model: {cfg.model.name_or_path}
pipeline_tag: {tag}
---
# Fine-tuned {Path(cfg.model.name_or_path).name}

Fine-tuned with {cfg.peft.peft_type if cfg.peft.use_peft else 'full'} fine-tuning
({'adapter merged' if merged else 'weights as trained'}).

- Base model: `{cfg.model.name_or_path}` (`{base}`)
- Data: `{source}`, raw splits sha256 `{lineage.get('data_sha256')}`
- Git commit: `{lineage['git_commit']}` (dirty: {lineage['git_dirty']})
- Strategy: {cfg.distributed.strategy}, world size {cfg.distributed.world_size}
- MLflow run: `{run_id}`

## Metrics (test split)
{_metrics_table(metrics)}

## Load it
```python
from transformers import {auto}, AutoTokenizer
model = {auto}.from_pretrained("{export_dir}")
tokenizer = AutoTokenizer.from_pretrained("{export_dir}")
```
{adapter}
## Params
```yaml
{yaml.safe_dump(cfg.model_dump(mode='json', include=set(CARD_SECTIONS)), sort_keys=False)}```
"""
