"""Where rank 0 sends training metrics: stdout, a DVC plots CSV, MLflow.

The CSV is written to a staging file and renamed at the end, so a failed run never clobbers the
previous run's curves; the history also rides in checkpoints so a resumed run's plot is whole.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from pathlib import Path

TRAIN_FIELDS = ["step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second",
                "num_input_tokens_seen"]
EVAL_FIELDS = ["step", "eval_loss"]


def log_batch(client, run_id: str, metrics: dict[str, float], step: int) -> None:
    """All metrics of one step in one MLflow request."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


class MetricSinks:
    def __init__(self, plots_dir: Path, mlflow_uri: str | None, run_id: str | None,
                 history: list[dict] | None = None):
        self.plots_dir = plots_dir
        self.history: list[dict] = list(history or [])
        self._client = None
        self._run_id = run_id
        if mlflow_uri and run_id:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=mlflow_uri)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: round(v, 6) if isinstance(v, float) else v
                                for k, v in metrics.items()}}
        self.history.append(row)
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in row.items())
        print(f"[train] {shown}", file=sys.stdout, flush=True)
        if self._client:
            log_batch(self._client, self._run_id, metrics, step)

    def finish(self) -> None:
        """Write `train.csv` (training rows) and `eval.csv` (eval rows) for `dvc plots`."""
        self.plots_dir.mkdir(parents=True, exist_ok=True)
        for name, fields, key in (("train.csv", TRAIN_FIELDS, "loss"),
                                  ("eval.csv", EVAL_FIELDS, "eval_loss")):
            final = self.plots_dir / name
            tmp = final.with_name(f".{name}.tmp-{os.getpid()}")
            with open(tmp, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
                writer.writeheader()
                for row in self.history:
                    if key in row:
                        writer.writerow(row)
            os.replace(tmp, final)
