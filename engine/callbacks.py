"""Callbacks: the small interface through which the loop reports, and how users plug in.

The loop calls, on the main process only:

    on_train_begin(state)              before the first step (after a resume: at its step)
    on_step_end(state)                 after every optimizer step
    on_log(state, logs)                a row of metrics: a logging window, an eval, an outer step
    on_evaluate(state, metrics)        after each in-training evaluation (eval_loss, ...)
    on_save(state, path)               after a checkpoint folder is complete
    on_train_end(state)                at the end, after the trained model is written

`state` is a `TrainState` (step, max_steps, epoch, num_input_tokens_seen). Built-in reporters
live in engine.reporters; a user callback is any class with some of these methods, named in
`logging.callbacks` as "module:Class" (importable from the project root) and built with no
arguments. Callbacks observe; stopping is the monitor's job (eval.early_stopping_*).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import PipelineError
from finetune.imports import load_object

HOOKS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


@dataclass
class TrainState:
    step: int
    max_steps: int
    epoch: float = 0.0
    num_input_tokens_seen: int = 0


class Callback:
    """Base class with no-op hooks; subclass and override what you need."""

    def on_train_begin(self, state: TrainState) -> None: ...

    def on_step_end(self, state: TrainState) -> None: ...

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


def load_user_callback(spec: str):
    """'module:Class' -> an instance (what logging.callbacks names)."""
    callback = load_object(spec, "logging.callbacks")()
    if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
        raise PipelineError(f"logging.callbacks: '{spec}' has none of the hooks {', '.join(HOOKS)}")
    return callback
