"""The tools a multi-turn rollout calls (engine.rollout.tools): TRL's error text for a call that
fails, and a tool that raises, hangs, burns its CPU seconds or exhausts its memory reported to
the model and counted instead of stopping the run."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.rollout.tools import ToolResult, ToolRunner, tool_schema
from finetune.errors import PipelineError


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


async def fetch(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    await asyncio.sleep(0)
    return key.upper()


def spin(n: int) -> int:
    """Count forever.

    Args:
        n: Where to start.
    """
    while True:
        n += 1


def hog(megabytes: int) -> int:
    """Hold a buffer.

    Args:
        megabytes: Its size.
    """
    return len(bytearray(megabytes * 2**20))


def _trls_failure_text(exc: Exception) -> str:
    """What TRL's GRPOTrainer._tool_call_loop makes the `tool` message's content of a call that
    raised: `str({"error": str(e)})` (result dict, then `str(result)` for the message)."""
    return str({"error": str(exc)})


def test_a_call_returns_its_result_as_text_and_a_failure_as_trls_error_text():
    run = ToolRunner({"add": add, "divide": divide, "fetch": fetch})
    assert run({"name": "add", "arguments": {"a": 2, "b": 40}}) == ToolResult("add", "42", False)
    assert run({"name": "fetch", "arguments": {"key": "ab"}}) == ToolResult("fetch", "AB", False)
    try:
        divide(1, 0)
    except ZeroDivisionError as exc:
        expected = _trls_failure_text(exc)
    assert run({"name": "divide", "arguments": {"a": 1, "b": 0}}) == ToolResult(
        "divide", expected, True)
    assert run({"name": "nope", "arguments": {}}) == ToolResult(
        "nope", _trls_failure_text(ValueError("Tool nope not found.")), True)
    assert run({"name": "add", "arguments": None}).failed  # arguments that were not JSON
    wrong = run({"name": "add", "arguments": {"a": 1, "c": 2}})
    assert wrong.failed and "unexpected keyword argument 'c'" in wrong.content
    assert (run.calls, run.failures) == (6, 4)


def test_a_hung_tool_times_out_in_the_worker_and_the_call_returns_at_once():
    run = ToolRunner({"sleepy": sleepy}, timeout=0.2)
    started = time.monotonic()
    result = run({"name": "sleepy", "arguments": {"seconds": 30}})
    assert time.monotonic() - started < 5
    assert result == ToolResult("sleepy", str({"error": "timed out after 0.2 s"}), True)
    assert run({"name": "sleepy", "arguments": {"seconds": 0}}).content == "awake"


def test_in_a_subprocess_a_tool_that_hangs_spins_or_hogs_memory_is_stopped_and_reported():
    run = ToolRunner({"sleepy": sleepy, "spin": spin, "hog": hog, "add": add}, timeout=20,
                     sandbox="subprocess", cpu_seconds=1, memory_mb=64)
    assert run({"name": "add", "arguments": {"a": 1, "b": 2}}) == ToolResult("add", "3", False)
    spun = run({"name": "spin", "arguments": {"n": 0}})
    assert spun == ToolResult("spin", str({"error": "used up its 1 CPU seconds"}), True)
    hogged = run({"name": "hog", "arguments": {"megabytes": 512}})
    assert hogged == ToolResult("hog", str({"error": "ran out of its 64 MB of memory"}), True)
    assert run({"name": "hog", "arguments": {"megabytes": 8}}).content == str(8 * 2**20)
    run.timeout = 0.5
    started = time.monotonic()
    assert run({"name": "sleepy", "arguments": {"seconds": 30}}).content == str(
        {"error": "timed out after 0.5 s"})
    assert time.monotonic() - started < 10
    assert (run.calls, run.failures) == (5, 3)


def test_the_schema_is_transformers_and_a_function_it_cannot_describe_is_one_line():
    from transformers.utils import get_json_schema

    assert tool_schema(add, "grpo.tools[0]") == get_json_schema(add)

    def undocumented(a: int) -> int:
        return a

    def unhinted(a):
        """Echo.

        Args:
            a: Anything.
        """
        return a

    for function in (undocumented, unhinted):
        with pytest.raises(PipelineError) as refused:
            tool_schema(function, "grpo.tools[1]")
        line = str(refused.value)
        assert line.startswith(f"grpo.tools[1]: {function.__qualname__} cannot be a tool: ")
        assert "\n" not in line
