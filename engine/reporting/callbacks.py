"""Callbacks: the small interface through which the loop reports, and how users plug in.

The loop calls, on the main process only:

    on_train_begin(state)              before the first step (after a resume: at its step)
    on_epoch_begin(state)              before the first step of an epoch
    on_step_begin(state)               before every optimizer step
    on_step_end(state)                 after every optimizer step
    on_epoch_end(state)                after the last step of an epoch
    on_log(state, logs)                a row of metrics: a logging window, an eval, an outer step
    on_evaluate(state, metrics)        after each in-training evaluation (eval_loss, ...)
    on_save(state, path)               after a checkpoint folder is complete
    on_train_end(state)                at the end, after the trained model is written

`state` is a `TrainState` (step, max_steps, epoch, num_input_tokens_seen, control). Built-in
reporters live in engine.reporting.reporters; a user callback is any class with some of these
methods, named in `logging.callbacks` as "module:Class" or {class: "module:Class", kwargs: {...}}
(importable from the project root). A callback steers the run through `state.control`, HF's
TrainerControl: set `should_training_stop`, `should_save` or `should_evaluate` in a hook and
the loop acts on it after the current step (on every rank: the main process's decision is
shared, one small broadcast per step, only when user callbacks are configured). A callback
with `state_dict()` / `load_state_dict()` has its state saved in each checkpoint and, with
`logging.restore_callback_states_from_checkpoint`, restored on resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import PipelineError
from finetune.imports import load_object

HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end",
         "on_log", "on_evaluate", "on_save", "on_train_end")


@dataclass
class TrainerControl:
    """What callbacks ask the loop to do after the current step (HF's names)."""

    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False

    def take(self) -> tuple[bool, bool, bool]:
        """The requests, cleared (save and evaluate are one-shot; stop stays)."""
        asked = (self.should_training_stop, self.should_save, self.should_evaluate)
        self.should_save = self.should_evaluate = False
        return asked


@dataclass
class TrainState:
    step: int
    max_steps: int
    epoch: float = 0.0
    num_input_tokens_seen: int = 0
    control: TrainerControl | None = None

    @property
    def global_step(self) -> int:
        """HF TrainerState's name for `step` (TRL hands reward functions a trainer_state)."""
        return self.step


class Callback:
    """Base class with no-op hooks; subclass and override what you need."""

    def on_train_begin(self, state: TrainState) -> None: ...

    def on_epoch_begin(self, state: TrainState) -> None: ...

    def on_step_begin(self, state: TrainState) -> None: ...

    def on_step_end(self, state: TrainState) -> None: ...

    def on_epoch_end(self, state: TrainState) -> None: ...

    def on_log(self, state: TrainState, logs: dict[str, Any]) -> None: ...

    def on_evaluate(self, state: TrainState, metrics: dict[str, float]) -> None: ...

    def on_save(self, state: TrainState, path: Path) -> None: ...

    def on_train_end(self, state: TrainState) -> None: ...


class CallbackList:
    """Calls each hook on every callback that defines it, in order."""

    def __init__(self, callbacks: list[Any]):
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)

        def call(*args, **kwargs) -> None:
            for cb in self.callbacks:
                method = getattr(cb, hook, None)
                if method is not None:
                    method(*args, **kwargs)

        return call

    def find(self, kind: type):
        return next((cb for cb in self.callbacks if isinstance(cb, kind)), None)


    def state_dicts(self) -> dict[str, Any]:
        """The states of the callbacks that have one, by position and class."""
        return {_key(i, cb): cb.state_dict() for i, cb in enumerate(self.callbacks)
                if callable(getattr(cb, "state_dict", None))}

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        for i, cb in enumerate(self.callbacks):
            if _key(i, cb) in states and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(states[_key(i, cb)])


def _key(index: int, callback: Any) -> str:
    return f"{index}:{type(callback).__qualname__}"


def _build(spec: str | dict, build):
    """The class a logging.callbacks entry names, passed with its kwargs to `build`; one line
    when the kwargs do not fit or the result has none of the hooks."""
    ref, kwargs = (spec, {}) if isinstance(spec, str) else (spec["class"], spec.get("kwargs", {}))
    klass = load_object(ref, "logging.callbacks")
    try:
        built = build(klass, kwargs)
    except TypeError as exc:
        raise PipelineError(f"logging.callbacks: '{ref}' cannot be built with kwargs "
                            f"{kwargs} ({exc})") from None
    if not any(callable(getattr(built, hook, None)) for hook in HOOKS):
        raise PipelineError(f"logging.callbacks: '{ref}' has none of the hooks {', '.join(HOOKS)}")
    return built


def check_user_callback(spec: str | dict) -> None:
    """Before launch: the class exists, takes these kwargs and has a hook (nothing built)."""
    import inspect

    def bind_only(klass, kwargs):
        inspect.signature(klass).bind(**kwargs)  # TypeError when the kwargs do not fit
        return klass

    _build(spec, bind_only)


def load_user_callback(spec: str | dict):
    """'module:Class', or {class: 'module:Class', kwargs: {...}} -> an instance (what
    logging.callbacks names)."""
    return _build(spec, lambda klass, kwargs: klass(**kwargs))
