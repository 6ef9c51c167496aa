"""What the loop does after an optimizer step (engine.reporting.monitor.plan_after_step), as a
pure decision: evaluation and checkpoints when due, what callbacks ask, early stopping (read as
the step's evaluation leaves it), a scheduler's signal. The runs that carry the plan out are
tests/test_training.py's (early stopping, callbacks, eval_delay, eval_on_save, resume)."""

from __future__ import annotations

import pytest

from engine.reporting.monitor import plan_after_step
from finetune.config.checkpoint import CheckpointConfig
from finetune.config.evaluation import EvalConfig

NOTHING = (False, False, False)


def plan(checkpoint: dict | None = None, ev: dict | None = None, **facts):
    step = facts.pop("step", 1)
    defaults = dict(epoch=0, epoch_end=False, last=False, asked=NOTHING, early_stop=False,
                    signalled=False, can_evaluate=True)
    return plan_after_step(CheckpointConfig(**(checkpoint or {})), EvalConfig(**(ev or {})),
                           step=step, **{**defaults, **facts})


def test_steps_strategies_evaluate_and_save_on_their_multiples_and_the_last_step():
    every = plan({"save_strategy": "steps", "save_steps": 4},
                 {"eval_strategy": "steps", "eval_steps": 3}, step=6)
    assert (every.evaluate, every.save_due, every.flush) == (True, False, True)
    both = plan({"save_steps": 4}, {"eval_strategy": "steps", "eval_steps": 3}, step=12)
    assert (both.evaluate, both.save_due) == (True, True)
    quiet = plan({"save_steps": 4}, {"eval_strategy": "steps", "eval_steps": 3}, step=5)
    assert (quiet.evaluate, quiet.save_due, quiet.flush) == (False, False, False)
    last = plan({"save_steps": 4}, {"eval_strategy": "steps", "eval_steps": 3}, step=5,
                last=True)
    assert (last.evaluate, last.save_due) == (True, True)


def test_zero_disables_and_no_held_out_data_means_no_evaluation():
    off = plan({"save_steps": 0}, {"eval_strategy": "steps", "eval_steps": 3, "eval_batches": 0},
               step=3, can_evaluate=False)
    assert (off.evaluate, off.save_due, off.save_strategy) == (False, False, "no")
    assert plan({"save_steps": 0}, step=7, last=True).save_due is False
    # eval due but nothing to evaluate on: no evaluation, though the rows are still flushed
    nodata = plan(ev={"eval_strategy": "steps", "eval_steps": 3}, step=3, can_evaluate=False)
    assert (nodata.evaluate, nodata.flush) == (False, True)


def test_eval_on_save_and_eval_delay():
    on_save = plan({"save_steps": 2}, {"eval_strategy": "no", "eval_on_save": True}, step=4)
    assert on_save.evaluate and on_save.save_due
    not_on_save = plan({"save_steps": 2}, {"eval_strategy": "no", "eval_on_save": False}, step=4)
    assert not not_on_save.evaluate
    delayed = {"eval_strategy": "steps", "eval_steps": 2, "eval_delay": 5}
    assert not plan(ev=delayed, step=4).evaluate and plan(ev=delayed, step=6).evaluate
    by_epoch = {"eval_strategy": "epoch", "eval_delay": 2}
    assert not plan(ev=by_epoch, step=9, epoch=0, epoch_end=True).evaluate
    assert plan(ev=by_epoch, step=18, epoch=1, epoch_end=True).evaluate


@pytest.mark.parametrize("asked, evaluate, save_due, flush", [
    ((True, False, False), False, False, True),
    ((False, True, False), False, True, True),
    ((False, False, True), True, False, True),
])
def test_what_a_callback_asks_is_done(asked, evaluate, save_due, flush):
    p = plan({"save_steps": 100}, {"eval_strategy": "steps", "eval_steps": 100}, step=3,
             asked=asked)
    assert (p.evaluate, p.save_due, p.flush, p.asked_stop) == (evaluate, save_due, flush,
                                                               asked[0])


def test_stopping_reads_the_monitor_after_the_evaluation_and_saves_unless_checkpoints_are_off():
    p = plan({"save_steps": 100}, {"eval_strategy": "steps", "eval_steps": 3}, step=3)
    assert not p.stops(early_stop=False)
    assert p.stops(early_stop=True) and p.saves(stop=True) and not p.saves(stop=False)
    off = plan({"save_steps": 0}, step=3)
    assert off.stops(early_stop=True) and not off.saves(stop=True)
    # the last step ends the run anyway: not a stop
    assert not plan(step=3, last=True).stops(early_stop=True)
    assert plan(step=3, asked=(True, False, False)).stops(early_stop=False)
    # a signal or a monitor that already wants out flushes the rows first
    assert plan({"save_steps": 100}, step=3, signalled=True).flush
    assert plan({"save_steps": 100}, step=3, early_stop=True).flush
