"""The rollout's environment contract (engine/rollout/environment.py) against TRL 1.16's
GRPOTrainer, the oracle: the tools it reads off an environment class (its source lines, run
here as written) are the ones `tool_methods` lists."""

from __future__ import annotations

import inspect

import pytest

from engine.rollout.environment import Environment, tool_methods
from finetune.errors import PipelineError


class Counter:
    """TRL's documented shape: state, reset, tools, a reward it owns."""

    def __init__(self):
        self.count, self.target = 0, None

    def reset(self, **row) -> str | None:
        self.count, self.target = 0, row["target"]
        return f"Start at 0, reach {self.target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    async def lookup(self, name: str) -> str:
        """An async tool (TRL runs it on its event loop)."""
        return name

    def get_reward(self) -> float:
        return float(self.count == self.target)

    def _helper(self) -> None:
        """Private: no tool."""

    @property
    def broken(self) -> int:
        raise AssertionError("a property is not read when the tools are listed")

    @staticmethod
    def describe(x: int) -> str:
        """A static method on the class is a function too (TRL lists it)."""
        return str(x)


class Subcounter(Counter):
    def decrement(self, by: int) -> int:
        """Subtract from the counter."""
        self.count -= by
        return self.count


def _trls_tools(environment) -> list:
    """GRPOTrainer._generate_and_score_completions's per-rollout tool list (TRL 1.16), as
    written there."""
    return [
        getattr(environment, member_name)
        for member_name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if member_name not in ("reset", "get_reward") and not member_name.startswith("_")
    ]


@pytest.mark.parametrize("klass", [Counter, Subcounter])
def test_the_tools_are_trls_reading_of_the_class(klass):
    env = klass()
    tools = tool_methods(env)
    assert list(tools.values()) == _trls_tools(env)
    assert set(tools) == {"describe", "increment", "lookup"} | (
        {"decrement"} if klass is Subcounter else set())
    assert tools["increment"](2) == 2 and env.count == 2  # bound to this rollout's instance
    assert isinstance(env, Environment)


def test_an_instance_per_rollout_keeps_its_own_state():
    first, second = Counter(), Counter()
    assert first.reset(target=3, prompt="p") == "Start at 0, reach 3."
    second.reset(target=1, prompt="q")
    tool_methods(first)["increment"](3)
    assert (first.get_reward(), second.get_reward()) == (1.0, 0.0)


def test_a_class_without_reset_is_no_environment():
    class Tools:
        def search(self, query: str) -> str:
            return query

    assert not isinstance(Tools(), Environment)
    with pytest.raises(PipelineError, match=r"^.*Tools is not an environment: it defines no "
                                            r"reset\(\*\*row\) method"):
        tool_methods(Tools())
