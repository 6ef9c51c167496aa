"""The end-of-run summary: the same table for the CLI and the Prefect artifact."""

from __future__ import annotations

import json

from finetune.workspace import Workspace
from tasks.tracking import run_id_of


def summary(ws: Workspace) -> dict:
    ev_file = ws.layout.metrics / "eval.json"
    ev = json.loads(ev_file.read_text()) if ev_file.exists() else {}
    registry_file = ws.layout.model_version
    return {
        "eval": ev,
        "registry": json.loads(registry_file.read_text()) if registry_file.exists() else None,
        "mlflow_run_id": run_id_of(ws),
        "mlflow_uri": ws.mlflow_uri(),
        # relative: what the summary prints is what a user in the project types
        "export_path": str(ws.layout.export.relative_to(ws.root)),
    }


def markdown(info: dict, ran: list[str] | None = None, cached: list[str] | None = None,
             experiment: str | None = None) -> str:
    ev = info.get("eval") or {}
    models = [ev.get(key) or {} for key in ("base", "finetuned")]
    # a language model's loss and perplexity lead; a method without them (grpo: rewards) has
    # only its own columns
    lead = [(title, key, digits) for title, key, digits in
            (("eval loss", "loss", 4), ("perplexity", "perplexity", 2))
            if any(key in m for m in models)]
    extra = sorted({k for m in models for k in m if "_stderr" not in k}
                   - {"loss", "perplexity"})
    lines = ["| model |" + "".join(f" {t} |" for t, _, _ in lead) + "".join(
        f" {k} |" for k in extra), "|---|" + "---|" * (len(lead) + len(extra))]
    for label, key in (("base", "base"), ("fine-tuned", "finetuned")):
        vals = ev.get(key)
        if vals:
            lines.append(f"| {label} |" + "".join(
                f" {vals.get(k, float('nan')):.{d}f} |" for _, k, d in lead)
                + "".join(f" {vals.get(k, float('nan')):.4f} |" for k in extra))
    if all("loss" in m for m in models) and all(models):
        delta = ev["base"]["loss"] - ev["finetuned"]["loss"]
        verdict = "improved" if delta > 0 else "did NOT improve"
        lines.append(f"\nfine-tuning {verdict} eval loss by {delta:+.4f}")
    lines.append(f"exported model: {info['export_path']} (AutoModelForCausalLM.from_pretrained)")
    if info["mlflow_run_id"]:
        lines.append(f"MLflow run: {info['mlflow_run_id']} in {info['mlflow_uri']}")
    else:  # DVC's run-cache restored the training (or MLflow logging is off)
        lines.append(f"MLflow run: none in {info['mlflow_uri']} (no training ran here for "
                     "these outputs: DVC restored them from its cache, or MLflow is off)")
    reg = info.get("registry")
    if reg and reg.get("registered"):
        lines.append(f"registered model: {reg['name']} v{reg['version']} "
                     f"({' + '.join(reg['aliases'])}): {reg['reason']}")
        if reg.get("table"):
            from tasks.gate import Row
            from tasks.gate import markdown as gate_table

            lines.append(gate_table([Row(**row) for row in reg["table"]], "\ngate decision:"))
    elif reg:
        lines.append(f"registered model: none ({reg.get('reason')})")
    if ran is not None:
        lines.append(f"stages ran: {', '.join(ran) or 'none'}; cached: {', '.join(cached or []) or 'none'}")
    if experiment:
        lines.append(f"DVC experiment: {experiment} (dvc exp show)")
    return "\n".join(lines)
