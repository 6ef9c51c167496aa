"""What a multi-turn rollout will drive: an environment, as TRL 1.16's GRPOTrainer takes one
(`environment_factory`), so that an environment written for TRL runs here unchanged.

The contract, TRL's:

- one instance per rollout, made by a factory (a class, or any callable without arguments):
  rollouts never share state. An instance is made once and reset before each rollout it
  serves (TRL keeps a pool of them), so `reset` must forget the previous rollout;
- `reset(**row)` receives every column of the rollout's dataset row (the prompt among them)
  before anything is generated, and returns None, or text that is appended to the prompt's
  last user message (the first observation);
- ours beyond TRL's: a `reset` that names a `seed` parameter also gets the rollout's seed
  (Gymnasium's `reset(seed=)`), derived from (training.seed, step, the row's global position
  in the step, the rollout's index in its group): an environment that draws random numbers
  from its own `random.Random(seed)` then does the same thing in a resumed run and on any
  number of processes, which a shared global generator cannot (its draws would depend on
  which rollouts a process ran before);
- its public methods are the model's tools (`tool_methods`): their names, signatures and
  docstrings are the tool schema the chat template renders; a call the model makes runs the
  method, and its return value goes back to the model as a tool message, until the model
  answers without calling one. `reset`, `get_reward` and names starting with '_' are not tools;
- `get_reward()`, optional (and possibly `async`): the environment's own score of the finished
  rollout, one more reward source beside the reward functions (weight 1, named after the
  class). The reward functions get the rollouts' environments too, as `environments=` (why a
  row column may not be called that: engine.rollout.scoring).

What drives them: `grpo.environment_factory` (a 'module:Class', or a mapping of names to
them with a per-row `environment` column choosing one, as TRL's dict factory does) is loaded by
`load_environments`, which makes one probe instance of each to read its tools (their schemas
are what the format stage renders into the prompts) and whether it owns a reward; an
`EnvironmentPool` hands each rollout of a batch an instance of its row's environment (made
once, reset before every rollout, as TRL pools them); engine.rollout.episodes runs the
episodes and engine.rollout.scoring passes the instances to the reward functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from finetune.datatypes.chat import ENVIRONMENT_COLUMN
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


class Environments:
    """The factories of grpo.environment_factory (`load_environments`): `factories` maps a
    name to its factory (the one factory of a single class under None), `schemas` each name
    to its tools' schemas (the stateless tools' first, then its methods' in name order),
    `reward_classes` the classes that own a reward (`get_reward`), each once; `key` is the
    params entry its messages name."""

    def __init__(self, factories: dict[str | None, Callable], schemas: dict[str | None, list],
                 reward_classes: list[type], key: str,
                 seeded: frozenset[str | None] = frozenset()):
        self.factories, self.schemas, self.key = factories, schemas, key
        self.reward_classes, self.seeded = reward_classes, seeded

    def takes_seed(self, name: str | None) -> bool:
        """The environment's `reset` names a `seed` parameter (it gets the rollout's seed)."""
        return name in self.seeded

    @property
    def named(self) -> bool:
        """A mapping: each row's `environment` column chooses one."""
        return None not in self.factories

    def name_of(self, row: dict, where: str) -> str | None:
        """The environment a row's rollouts use (None for the single one); one line naming
        `where` for a row whose column is missing or names none of them."""
        if not self.named:
            return None
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.factories:
            known = ", ".join(map(str, self.factories))
            what = ("has no 'environment' column" if ENVIRONMENT_COLUMN not in row
                    else f"names environment {name!r}")
            raise PipelineError(f"{where} {what}; {self.key} is a mapping, so each row names "
                                f"one of its environments: {known}")
        return name

    def pool(self) -> EnvironmentPool:
        return EnvironmentPool(self.factories)


class EnvironmentPool:
    """Instances made once and reused: each batch (`draw`) hands every rollout its own
    instance of its environment, making more only when a batch needs more of one at a time
    than earlier batches did (TRL's pool)."""

    def __init__(self, factories: dict[str | None, Callable]):
        self.factories = factories
        self.instances: dict[str | None, list] = {name: [] for name in factories}

    def draw(self, names: list[str | None]) -> list:
        """One instance per entry of `names` (a rollout's environment), none shared."""
        used: dict[str | None, int] = {}
        out = []
        for name in names:
            have = self.instances[name]
            k = used.get(name, 0)
            if k == len(have):
                have.append(self.factories[name]())
            used[name] = k + 1
            out.append(have[k])
        return out


def load_environments(spec: str | dict[str, str] | None, key: str,
                      functions: dict[str, Callable] | None = None) -> Environments | None:
    """grpo.environment_factory loaded: each 'module:Class' (or callable without arguments)
    imported and called once to read its tools (`tool_methods`) and their schemas (after
    `functions`' schemas, the stateless tools every rollout has); one line naming the entry
    (`key`, or `key.NAME` in a mapping) for one that does not load, makes no environment, or
    has a method the chat template cannot describe. None when `spec` is empty."""
    from engine.rollout.tools import tool_schema
    from finetune.imports import load_object

    if not spec:
        return None
    entries = {None: spec} if isinstance(spec, str) else dict(spec)
    tools_key = f"{key.rsplit('.', 1)[0]}.tools"
    shared = [tool_schema(f, f"{tools_key}[{i}]") for i, f in enumerate((functions or {}).values())]
    factories, schemas, rewards, seeded = {}, {}, [], set()
    for name, ref in entries.items():
        where = key if name is None else f"{key}.{name}"
        factory = load_object(ref, where)
        if not callable(factory):
            raise PipelineError(f"{where}: '{ref}' is not a class")
        try:
            probe = factory()
        except Exception as exc:
            raise PipelineError(f"{where}: {ref}() failed: {type(exc).__name__}: {exc}") from None
        try:
            methods = tool_methods(probe)
        except PipelineError as exc:
            raise PipelineError(f"{where}: {exc}") from None
        clash = sorted(set(methods) & set(functions or {}))
        if clash:
            raise PipelineError(f"{where}: its tool {clash[0]} has the name of one of "
                                f"{tools_key}; the model calls a tool by its name: rename one")
        factories[name] = factory
        schemas[name] = shared + [tool_schema(m, f"{where} ({type(probe).__qualname__})")
                                  for m in methods.values()]
        klass = type(probe)
        if callable(getattr(klass, "get_reward", None)) and klass not in rewards:
            rewards.append(klass)
        if _names_seed(probe.reset):
            seeded.add(name)
    return Environments(factories, schemas, rewards, key, frozenset(seeded))


def _names_seed(reset: Callable) -> bool:
    """`reset` has a parameter called `seed` (not only **row)."""
    try:
        parameter = inspect.signature(reset).parameters.get("seed")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def environment_reward(klass: type) -> Callable:
    """The reward function of an environment class that owns its reward: each rollout's
    `get_reward()` where the rollout's environment is exactly `klass` (TRL's exact-type
    match), else None; awaited where `get_reward` is async."""

    if inspect.iscoroutinefunction(klass.get_reward):
        async def reward(environments=None, **kwargs):
            return [await e.get_reward() if type(e) is klass else None
                    for e in _given(environments, klass)]
    else:
        def reward(environments=None, **kwargs):
            return [e.get_reward() if type(e) is klass else None
                    for e in _given(environments, klass)]
    reward.__name__ = klass.__name__
    return reward


def _given(environments, klass: type) -> list:
    if environments is None:
        raise PipelineError(f"{klass.__name__}.get_reward needs the rollouts' environments, "
                            "which only an environment rollout passes")
    return environments
