"""When to evaluate and save, and what the evaluations say: best metric, early stopping.

Every rank holds the same monitor and sees the same (all-reduced) eval metrics, so every rank
takes the same decision to stop without extra communication. The monitor's state rides in
checkpoints, so a resumed run stops at the same step as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def due(strategy: str, every: int, step: int, epoch_end: bool, last: bool) -> bool:
    """Is an eval/save with this strategy ('no', 'steps', 'epoch') due after `step`? Steps
    with `every` 0: only at the last step (saving passes its effective strategy, 'no')."""
    if strategy == "no":
        return False
    if strategy == "steps" and every == 0:
        return last
    if last:
        return True
    return epoch_end if strategy == "epoch" else step % every == 0


@dataclass
class Monitor:
    metric: str | None = None
    higher_wins: bool = False
    patience: int | None = None
    threshold: float = 0.0
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0

    @classmethod
    def from_config(cls, cfg) -> "Monitor":
        return cls(metric=cfg.checkpoint.metric_for_best_model,
                   higher_wins=cfg.checkpoint.higher_wins,
                   patience=cfg.eval.early_stopping_patience,
                   threshold=cfg.eval.early_stopping_threshold)

    @property
    def best_by(self) -> tuple[str, bool] | None:
        """For checkpoint rotation: (metric, higher wins)."""
        return (self.metric, self.higher_wins) if self.metric else None

    def update(self, metrics: dict[str, float], step: int) -> None:
        """HF semantics: any improvement is the new best; only one above `threshold` resets
        the patience counter."""
        if self.metric is None or self.metric not in metrics:
            return
        value = metrics[self.metric]
        if self.best is None:
            self.best, self.best_step, self.bad_evals = value, step, 0
            return
        gain = value - self.best if self.higher_wins else self.best - value
        if gain > 0:
            self.best, self.best_step = value, step
        self.bad_evals = 0 if gain > self.threshold else self.bad_evals + 1

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad_evals >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in ("best", "best_step", "bad_evals")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
