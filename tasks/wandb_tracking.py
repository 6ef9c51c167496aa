"""W&B reporting (`logging.report_to: [wandb]`, Accelerate's `log_with: wandb`).

Fed by the same rank-0 row relay as MLflow: the train stage opens the W&B run next to the MLflow
run and forwards every row the worker logs, so the workers never import wandb (its service
process and import would sit on the first step's critical path on every rank). W&B's own
environment applies as usual: `WANDB_MODE=offline` writes the run under
`<logging_dir>/wandb/offline-run-*` without any network (`wandb sync` uploads it later),
`WANDB_ENTITY`, `WANDB_API_KEY` and so on.
"""

from __future__ import annotations

from typing import Any

from finetune.errors import PipelineError
from finetune.workspace import Workspace


def wandb_module():
    try:
        import wandb
    except ImportError as exc:
        raise PipelineError(
            "logging.report_to: wandb needs the wandb package, which is not installed: "
            "pip install 'finetune-pipeline[wandb]' (or drop wandb from report_to)") from exc
    return wandb


class WandbRun:
    """One training's W&B run: `log(row)` for the relay, `finish(ok)` at the end."""

    def __init__(self, ws: Workspace, mlflow_run_id: str | None, tags: dict[str, str]):
        wandb = wandb_module()
        log_cfg = ws.config.logging
        run_dir = ws.root / log_cfg.logging_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=log_cfg.wandb_project or log_cfg.experiment_name,
            name=log_cfg.run_name,
            dir=str(run_dir),
            config=ws.config.model_dump(mode="json"),
            tags=[f"strategy:{ws.config.distributed.strategy}"],
            notes=f"mlflow run {mlflow_run_id}" if mlflow_run_id else None,
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run.config.update({"lineage": tags}, allow_val_change=True)

    def log(self, row: dict[str, Any]) -> None:
        row = dict(row)
        step = int(row.pop("step"))
        self.run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)

    def summary(self, metrics: dict[str, float]) -> None:
        self.run.summary.update(metrics)

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
