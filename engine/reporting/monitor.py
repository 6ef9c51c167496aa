"""When to evaluate and save, and what the evaluations say: best metric, early stopping.

Every rank holds the same monitor and sees the same (all-reduced) eval metrics, so every rank
takes the same decision to stop without extra communication. The monitor's state rides in
checkpoints, so a resumed run stops at the same step as an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from finetune.errors import PipelineError


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



@dataclass(frozen=True)
class StepPlan:
    """What the loop does after an optimizer step, decided from the step's facts before any
    of it runs (`plan_after_step`), so the loop's method only carries it out in order: hand
    the logged rows on, evaluate, save, stop. Only stopping waits for the evaluation (early
    stopping reads the monitor as this step's evaluation leaves it): `stops` and `saves`."""

    flush: bool  # hand every logged row on first: a checkpoint's history holds them all
    evaluate: bool
    save_due: bool  # the save strategy's, or a callback's
    asked_stop: bool  # a callback set control.should_training_stop
    last: bool
    save_strategy: str  # checkpoint.effective_save_strategy

    def stops(self, early_stop: bool) -> bool:
        """Does the run end here? Early stopping or a callback; the last step ends anyway."""
        return (early_stop or self.asked_stop) and not self.last

    def saves(self, stop: bool) -> bool:
        """A checkpoint now: when due, and at a stop unless checkpoints are off."""
        return self.save_due or (stop and self.save_strategy != "no")


def plan_after_step(checkpoint, ev, *, step: int, epoch: int, epoch_end: bool, last: bool,
                    asked: tuple[bool, bool, bool], early_stop: bool, signalled: bool,
                    can_evaluate: bool) -> StepPlan:
    """The plan for `step` from the `checkpoint` and `eval` sections and what happened:
    `epoch` (epochs completed before this step's end), `asked` (stop, save, evaluate as the
    callbacks asked), `early_stop` (the monitor before this step's evaluation), `signalled`
    (a scheduler's stop signal reached a rank), `can_evaluate` (held-out data, and eval runs
    during training)."""
    asked_stop, asked_save, asked_eval = asked
    on_save = ev.eval_on_save  # read every step: dvc.yaml's completeness test sees it
    save_due = due(checkpoint.effective_save_strategy, checkpoint.save_steps, step, epoch_end,
                   last) or asked_save
    eval_due = (due(ev.effective_eval_strategy, ev.eval_steps, step, epoch_end, last) and (
        ev.eval_delay <= (epoch + int(epoch_end) if ev.eval_strategy == "epoch" else step))
    ) or asked_eval
    return StepPlan(
        flush=eval_due or save_due or asked_stop or early_stop or signalled,
        evaluate=can_evaluate and (eval_due or (save_due and on_save)),
        save_due=save_due, asked_stop=asked_stop, last=last,
        save_strategy=checkpoint.effective_save_strategy)

@dataclass
class Monitor:
    metric: str | None = None
    higher_wins: bool = False
    patience: int | None = None
    threshold: float = 0.0
    #: eval.early_stopping_threshold_stderr: the improvement must also exceed this many
    #: standard errors of the difference from the best (the metric's `<metric>_stderr`)
    threshold_stderr: float = 0.0
    best: float | None = None
    best_step: int | None = None
    best_stderr: float | None = None
    bad_evals: int = 0

    @classmethod
    def from_config(cls, cfg) -> "Monitor":
        return cls(metric=cfg.checkpoint.metric_for_best_model,
                   higher_wins=cfg.checkpoint.higher_wins,
                   patience=cfg.eval.early_stopping_patience,
                   threshold=cfg.eval.early_stopping_threshold,
                   threshold_stderr=cfg.eval.early_stopping_threshold_stderr)

    @property
    def best_by(self) -> tuple[str, bool] | None:
        """For checkpoint rotation: (metric, higher wins)."""
        return (self.metric, self.higher_wins) if self.metric else None

    def update(self, metrics: dict[str, float], step: int) -> None:
        """HF semantics: any improvement is the new best; only one above `threshold` (and,
        with `threshold_stderr`, above that many standard errors of the difference from the
        best: sqrt(se^2 + best_se^2), as the registry gate's min_improvement_stderr) resets
        the patience counter."""
        if self.metric is None or self.metric not in metrics:
            return
        value = metrics[self.metric]
        stderr = metrics.get(f"{self.metric}_stderr")
        if self.threshold_stderr and stderr is None:
            raise PipelineError(
                f"eval.early_stopping_threshold_stderr: {self.metric} has no standard error "
                "at this evaluation (fewer than 2 rows scored it, or it is not a mean over "
                "rows of one dataset type); use eval.early_stopping_threshold")
        if self.best is None:
            self.best, self.best_step, self.best_stderr, self.bad_evals = value, step, stderr, 0
            return
        gain = value - self.best if self.higher_wins else self.best - value
        needed = self.threshold
        if self.threshold_stderr:
            needed = max(needed, self.threshold_stderr * math.hypot(stderr, self.best_stderr or 0.0))
        improved = gain > self.threshold and gain > needed
        if gain > 0:
            self.best, self.best_step, self.best_stderr = value, step, stderr
        self.bad_evals = 0 if improved else self.bad_evals + 1

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad_evals >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items()
                if k in ("best", "best_step", "best_stderr", "bad_evals")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
