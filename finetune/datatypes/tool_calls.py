"""Scoring tool calls from greedy generations: did the model call the tools the reference
turn called, with the same arguments?

Templates write calls differently (Qwen's `<tool_call>{...}</tool_call>`, Llama 3.1's bare
`{"name": ..., "parameters": ...}`, Mistral's `[TOOL_CALLS][...]`, a plain-text template's
`Call: {...}`), but every one of them writes each call as a JSON object with its name and its
arguments. So the parser is the template-free one: every JSON object in the generated text
(alone or in a list) with a string `name` and `arguments` or `parameters` (an object, or a
string holding one, OpenAI's wire form) is a call, in order. Arguments compare as parsed JSON:
key order and spacing do not matter, values do (1 and "1" differ).
"""

from __future__ import annotations

import json
from typing import Any

from finetune.datatypes.metrics import TOOL_CALL_KEYS, means

__all__ = ["TOOL_CALL_KEYS", "parse_tool_calls", "score_tool_calls"]

_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The calls written in `text`, as [{name, arguments}] in order (arguments None when
    they are not a JSON object)."""
    calls: list[dict[str, Any]] = []
    at = 0
    while True:
        starts = [i for i in (text.find("{", at), text.find("[", at)) if i >= 0]
        if not starts:
            return calls
        at = min(starts)
        try:
            value, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            at += 1
            continue
        found = [call for item in (value if isinstance(value, list) else [value])
                 if (call := _call(item)) is not None]
        calls.extend(found)
        at = end if found or isinstance(value, dict) else at + 1


def _call(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    value = value.get("function", value) if isinstance(value.get("function"), dict) else value
    name = value.get("name")
    if not isinstance(name, str) or not ("arguments" in value or "parameters" in value):
        return None
    return {"name": name, "arguments": _arguments(value.get("arguments",
                                                            value.get("parameters")))}


def _arguments(value: Any) -> dict | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def tool_call_rows(predictions: list[str], references: list[list[dict]]
                   ) -> dict[str, list[float]]:
    """Per reference turn: `tool_name_match` 1.0 when the generation calls the same tools in
    the same order, `tool_arguments_match` 1.0 when each call's arguments are also equal."""
    rows: dict[str, list[float]] = {key: [] for key in TOOL_CALL_KEYS}
    for text, want in zip(predictions, references, strict=True):
        got = parse_tool_calls(text)
        same_names = [c["name"] for c in got] == [c["name"] for c in want]
        rows["tool_name_match"].append(float(same_names))
        rows["tool_arguments_match"].append(float(same_names and all(
            g["arguments"] is not None and g["arguments"] == _arguments(w["arguments"])
            for g, w in zip(got, want))))
    return rows


def score_tool_calls(predictions: list[str], references: list[list[dict]]) -> dict[str, float]:
    """`tool_call_rows`' means over the turns."""
    return means(tool_call_rows(predictions, references))
