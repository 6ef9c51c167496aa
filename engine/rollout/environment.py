"""What a multi-turn rollout will drive: an environment, as TRL 1.16's GRPOTrainer takes one
(`environment_factory`), so that an environment written for TRL runs here unchanged.

The contract, TRL's:

- one instance per rollout, made by a factory (a class, or any callable without arguments):
  rollouts never share state. An instance is made once and reset before each rollout it
  serves (TRL keeps a pool of them), so `reset` must forget the previous rollout;
- `reset(**row)` receives every column of the rollout's dataset row (the prompt among them)
  before anything is generated, and returns None, or text that is appended to the prompt's
  last user message (the first observation);
- its public methods are the model's tools (`tool_methods`): their names, signatures and
  docstrings are the tool schema the chat template renders; a call the model makes runs the
  method, and its return value goes back to the model as a tool message, until the model
  answers without calling one. `reset`, `get_reward` and names starting with '_' are not tools;
- `get_reward()`, optional (and possibly `async`): the environment's own score of the finished
  rollout, one more reward source beside the reward functions (weight 1, named after the
  class). The reward functions get the rollouts' environments too, as `environments=` (why a
  row column may not be called that: engine.rollout.scoring).

Nothing drives an environment yet: GRPO's rollout is one completion per prompt
(engine.rollout.local). The contract and what the loop will read of an environment are fixed
here first, so the loop is written against them and tested with TRL's own reading of a class
(tests/test_rollout_environment.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from finetune.errors import PipelineError

#: the methods an environment may define that are not tools (TRL's names)
NOT_TOOLS = ("reset", "get_reward")


@runtime_checkable
class Environment(Protocol):
    """One rollout's environment (see the module docstring). `reset` is the one member every
    environment has; its other public methods are its tools, and `get_reward` is optional."""

    def reset(self, **row: Any) -> str | None:
        """Start a rollout of the dataset row `row` (all its columns): None, or text appended
        to the prompt's last user message."""
        ...


def tool_methods(environment: object) -> dict[str, Callable]:
    """name -> bound method, for each tool of `environment`: the functions its class defines or
    inherits, except `reset`, `get_reward` and names starting with '_', in name order. Read
    off the class, as TRL reads them (inspect.getmembers on the type: a property is not
    evaluated, and is no tool). One line if the class has no `reset`, which TRL refuses too."""
    klass = type(environment)
    functions = dict(inspect.getmembers(klass, predicate=inspect.isfunction))
    if "reset" not in functions:
        raise PipelineError(f"{klass.__qualname__} is not an environment: it defines no "
                            "reset(**row) method (called before each rollout)")
    return {name: getattr(environment, name) for name in functions
            if name not in NOT_TOOLS and not name.startswith("_")}
