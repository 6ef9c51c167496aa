"""The training curves as one PNG (for MLflow, where `dvc plots` is not at hand).

Drawn from the same `train.csv` / `eval.csv` that `dvc plots show` renders, so the two views
cannot disagree. No timestamp or version metadata is embedded: the same curves give the same
bytes.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path


def _read(path: Path, column: str) -> tuple[list[float], list[float]]:
    if not path.exists():
        return [], []
    steps, values = [], []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get(column) not in (None, ""):
                steps.append(float(row["step"]))
                values.append(float(row[column]))
    return steps, values


def render_curves(plots_dir: Path, name: str = "curves.png") -> Path:
    """Loss and eval loss over steps (left) and the learning rate (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, lr_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for file, column, label in (("train.csv", "loss", "train loss"),
                                ("eval.csv", "eval_loss", "eval loss")):
        steps, values = _read(plots_dir / file, column)
        if steps:
            loss_ax.plot(steps, values, marker="o" if column == "eval_loss" else None,
                         label=label)
    loss_ax.set(xlabel="step", ylabel="loss", title="Training and eval loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    steps, values = _read(plots_dir / "train.csv", "learning_rate")
    lr_ax.plot(steps, values)
    lr_ax.set(xlabel="step", ylabel="learning rate", title="Learning rate")
    lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    final = plots_dir / name
    tmp = final.with_name(f".{name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png", metadata={"Software": None})
    plt.close(fig)
    os.replace(tmp, final)
    return final
