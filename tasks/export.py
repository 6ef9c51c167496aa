"""Stage 6, export: the formats export.formats lists, a model card, a registry entry.

Each format is a module of tasks/exporters (its registry: `tasks.exporters.EXPORTERS`), written
into one staging folder that replaces `data/export` only when all are written. By default:
`data/export` loads with `AutoModelForCausalLM.from_pretrained` and nothing else (safetensors
weights, adapter merged; tokenizer, generation config and a README, the model card recording
base model, data hash, params, metrics and commit); `data/export/adapter` is the PEFT adapter
alone, for users who keep the base model; `data/export/quantized` the QAT model converted;
`data/export/gguf` llama.cpp's files when export.gguf lists types (tasks/exporters/gguf, whose
checks run before any format writes). The model card is written last: it lists what the
formats wrote. The merged model is then logged to the training's MLflow run (transformers
flavour), registered, tagged with a lineage summary (the whole lineage is the run's
`lineage.json`), the GGUF files' and every weight file's sha256, and gated (see tasks.registry).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.export import choose_device, load_processor, load_tokenizer, load_trained
from finetune.config.compat import check_machine
from finetune.errors import PipelineError
from finetune.files import atomic_dir, write_json_atomic
from finetune.workspace import Workspace
from tasks import gate, registry, tracking
from tasks.exporters import ExportContext, preflight, resolve
from tasks.exporters import tags as format_tags
from tasks.exporters.card import model_card


def export(ws: Workspace) -> dict[str, Path]:
    cfg = ws.config
    exporters = resolve(cfg.export.formats)
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
    lineage = tracking.lineage(ws)
    with atomic_dir(ws.layout.export) as staging:
        ctx = ExportContext(ws, model, tok, metrics, lineage, run_id, staging,
                            tuple(cfg.export.formats))
        preflight(ctx)
        for exporter in exporters:
            exporter.write(ctx)
        (staging / "README.md").write_text(model_card(ctx))  # last: it lists what they wrote
    record = {"registered": False, "reason": "registry.register_model is false"}
    written = format_tags(cfg.export.formats, ws.layout.export)  # e.g. the GGUF files' sha256
    if run_id:
        tracking.log_lineage(ws, run_id, lineage)
        tracking.set_tags(ws, run_id, {"export_path": str(ws.layout.export), **written})
        tracking.client(ws).log_artifact(run_id, str(ws.layout.export / "README.md"), "export")
        if cfg.registry.register_model:
            record = _register(ws, run_id, ctx.servable, tok, gate_value, metrics,
                               lineage, written)
        tracking.finish_run(ws, run_id)
    elif cfg.registry.register_model:
        record = {"registered": False, "reason": f"no MLflow run in {ws.layout.train_run}"}
    write_json_atomic(ws.layout.model_version, record)
    return {"export": ws.layout.export, "model_version": ws.layout.model_version}


def _vision_processor(cfg, tok, root):
    """The model's processor when it reads images (the registry logs it), else None."""
    processor = load_processor(cfg, tok, root)
    return processor if getattr(processor, "image_processor", None) is not None else None


def _gate_value(ws: Workspace, metrics: dict) -> float | None:
    """The new model's gate metric; None (never promoted) when evaluate has not produced it,
    e.g. `finetune stage export` run straight after train."""
    key = ws.config.registry.gate_metric.removeprefix("eval.")
    value = (metrics.get("finetuned") or {}).get(key)
    return None if value is None else float(value)


def _register(ws: Workspace, run_id: str, model, tok, gate_value: float | None,
              metrics: dict, lineage: dict[str, str], written: dict[str, str]) -> dict:
    cfg = ws.config
    fallback = cfg.logging.experiment_name  # read either way: dvc.yaml must list it
    name = cfg.registry.registered_model_name or fallback
    version = registry.log_and_register(ws.mlflow_uri(), run_id, model, tok, name,
                                        cfg.eval.generation_max_new_tokens,
                                        (ws.layout.export / "README.md").read_text(),
                                        pipeline_tag=cfg.model_task.pipeline_tag,
                                        processor=_vision_processor(cfg, tok, ws.root))
    client = tracking.client(ws)
    # the version's lineage is its run's lineage.json; its page shows the summary; the weight
    # files' sha256 are what `finetune reproduce` checks a rebuild against
    registry.tag_version(client, name, version,
                         {**tracking.lineage_summary(lineage), **written,
                          **registry.weight_tags(ws.layout.export)})
    # the guards' metrics and the standard errors, keyed as the training's MLflow run has them
    finetuned = {f"eval.{k}": v for k, v in (metrics.get("finetuned") or {}).items()}
    finetuned.update(gate.contamination_metrics(metrics.get("contamination") or {}))
    decision = registry.promote(client, name, version, gate_value, cfg.registry, finetuned)
    aliases = [cfg.registry.candidate_alias] + ([cfg.registry.champion_alias]
                                                 if decision.promoted else [])
    print(f"[export] registered {name} v{version} as {' + '.join(aliases)}: {decision.reason}",
          flush=True)
    if cfg.registry.guard_metrics or cfg.registry.min_improvement_stderr:
        print(decision.markdown(), flush=True)  # the table (always in model_version.json)
    tracking.set_tags(ws, run_id, {"registered_model": f"{name}/{version}",
                                   "promoted": str(decision.promoted).lower()})
    return {**decision.as_dict(), "aliases": aliases,
            "model_uri": f"models:/{name}/{version}"}
