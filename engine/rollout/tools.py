"""The tools a rollout's model calls, run as TRL's GRPOTrainer runs them (`_tool_call_loop`), with
a tool that misbehaves reported to the model instead of stopping the run.

A call is `{name, arguments}` (finetune.datatypes.tool_calls.parse_tool_calls reads it from any
template's JSON). What goes back to the model as the `tool` message's content is `str(result)`,
or, for a call that failed, TRL's `{'error': '<message>'}` as that text, and the failure is
counted (`tools/failure_frequency`):

- a name that is no tool: "Tool <name> not found." (TRL's words);
- arguments that are not a JSON object, or that the function's signature does not take;
- an exception the tool raised: its message;
- a call still running after `timeout` seconds: "timed out after <timeout> s";
- under `sandbox="subprocess"`, a call that ran out of its CPU seconds or memory.

Where a call runs: `sandbox="none"` (the default) in this process, on a helper thread so that a
timeout returns at once (a hung call's thread is left to finish on its own, as a daemon: Python
cannot stop a thread); `sandbox="subprocess"`: in a child forked for the call, with a CPU-time
limit (RLIMIT_CPU) and a memory one (RLIMIT_AS: `memory_mb` beyond what the fork starts with),
killed at the timeout: for tools that run model-written code. A coroutine function is awaited.
The schema the chat template renders is transformers' `get_json_schema` of the function (its
type hints and Google-style docstring), as TRL builds it; a function it cannot describe is
refused in one line naming the params key.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.errors import PipelineError

#: the places a tool call can run (grpo.tool_sandbox)
SANDBOXES = ("none", "subprocess")


def tool_schema(function: Callable, where: str) -> dict:
    """The JSON schema of `function` for the chat template (transformers' get_json_schema, the
    one TRL renders), or one line naming `where` (the params entry) and what is missing."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (DocstringParsingException,
                                                        TypeHintParsingException)

    try:
        return get_json_schema(function)
    except (DocstringParsingException, TypeHintParsingException, ValueError) as exc:
        name = getattr(function, "__qualname__", repr(function))
        raise PipelineError(f"{where}: {name} cannot be a tool: {exc} (a tool needs a type "
                            "hint on every argument and a Google-style docstring describing "
                            "it, as transformers' get_json_schema reads them)") from None


def load_tools(refs: list[str], key: str) -> dict[str, Callable]:
    """name -> function for each 'module:function' (or 'path/file.py:function') of `refs`, the
    params' `key`; one line naming `key[i]` for one that is not a function, or whose name an
    earlier one has (the model calls a tool by its name)."""
    from finetune.imports import load_object

    tools: dict[str, Callable] = {}
    for i, ref in enumerate(refs):
        function = load_object(ref, f"{key}[{i}]")
        if not callable(function):
            raise PipelineError(f"{key}[{i}]: '{ref}' is not a function")
        name = getattr(function, "__name__", ref)
        if name in tools:
            raise PipelineError(f"{key}[{i}]: '{ref}' is named {name} as an earlier tool is; "
                                "the model calls a tool by its name: rename one")
        tools[name] = function
    return tools


@dataclass(frozen=True)
class ToolResult:
    """One call's `tool` message: the tool's name, the content the model reads, and whether
    the call failed."""

    name: str
    content: str
    failed: bool


def _error(name: str, message: str) -> ToolResult:
    return ToolResult(name, str({"error": message}), True)


def _invoke(function: Callable, arguments: dict) -> Any:
    result = function(**arguments)
    if inspect.isawaitable(result):
        async def wait():
            return await result
        result = asyncio.run(wait())
    return result


def _address_space() -> int:
    """This process's virtual memory size in bytes (/proc/self/statm's first field)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


class ToolRunner:
    """Runs the calls of one set of tools (`name -> function`, the bound methods of an
    environment included) and counts them."""

    def __init__(self, tools: dict[str, Callable], timeout: float | None = None,
                 sandbox: str = "none", cpu_seconds: int = 10, memory_mb: int = 1024):
        if sandbox not in SANDBOXES:
            raise ValueError(f"sandbox {sandbox!r}: one of {', '.join(SANDBOXES)}")
        self.tools, self.timeout, self.sandbox = tools, timeout, sandbox
        self.cpu_seconds, self.memory_mb = cpu_seconds, memory_mb
        self.calls = self.failures = 0

    def __call__(self, call: dict) -> ToolResult:
        self.calls += 1
        result = self._run(call.get("name"), call.get("arguments"))
        self.failures += result.failed
        return result

    def _run(self, name: Any, arguments: Any) -> ToolResult:
        if not isinstance(name, str) or name not in self.tools:
            return _error(str(name), f"Tool {name} not found.")
        if not isinstance(arguments, dict):
            return _error(name, "the arguments are not a JSON object")
        function = self.tools[name]
        if self.sandbox == "subprocess":
            return self._in_child(name, function, arguments)
        return self._in_thread(name, function, arguments)

    def _in_thread(self, name: str, function: Callable, arguments: dict) -> ToolResult:
        box: dict = {}

        def target():
            try:
                box["result"] = _invoke(function, arguments)
            except BaseException as exc:  # the tool's failure is the model's to read
                box["error"] = str(exc) or type(exc).__name__

        if self.timeout is None:
            target()
        else:
            thread = threading.Thread(target=target, daemon=True, name=f"tool {name}")
            thread.start()
            thread.join(self.timeout)
            if thread.is_alive():
                return _error(name, f"timed out after {self.timeout:g} s")
        if "error" in box:
            return _error(name, box["error"])
        return ToolResult(name, str(box["result"]), False)

    def _in_child(self, name: str, function: Callable, arguments: dict) -> ToolResult:
        context = multiprocessing.get_context("fork")  # the function need not be picklable
        reader, writer = context.Pipe(duplex=False)
        cpu, memory = self.cpu_seconds, self.memory_mb * 2**20

        def child():
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            # the fork shares the worker's address space (torch's libraries and all): the
            # limit is on what the call adds to it
            limit = _address_space() + memory
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            try:
                writer.send(("result", str(_invoke(function, arguments))))
            except MemoryError:
                writer.send(("error", f"ran out of its {self.memory_mb} MB of memory"))
            except BaseException as exc:
                writer.send(("error", str(exc) or type(exc).__name__))

        process = context.Process(target=child, daemon=True, name=f"tool {name}")
        process.start()
        writer.close()
        try:
            ready = reader.poll(self.timeout)
            if not ready:
                return _error(name, f"timed out after {self.timeout:g} s")
            try:
                kind, text = reader.recv()
            except EOFError:  # killed: SIGXCPU past its CPU seconds, or by the memory limit
                process.join()
                why = (f"used up its {cpu} CPU seconds" if process.exitcode == -24
                       else f"ended with exit code {process.exitcode}")
                return _error(name, why)
            return _error(name, text) if kind == "error" else ToolResult(name, text, False)
        finally:
            if process.is_alive():
                process.kill()
            process.join()
            reader.close()
