"""Conversations as rows hold them -> one checked form every conversational type renders.

Rows hold a list of messages, OpenAI style (`role`/`content`) or ShareGPT (`from`/`value`;
`human` -> user, `gpt` -> assistant, LLaMA-Factory's `function_call` -> an assistant call and
`observation` -> a tool result). Agent data adds three things, each in the form chat templates
read (transformers' documented message format), whatever form the row wrote it in:

- assistant `tool_calls`: [{"type": "function", "id"?, "function": {"name", "arguments"}}],
  arguments a JSON object (a JSON string is parsed; the bare {"name", "arguments"} form and
  Llama's `parameters` are accepted);
- `tool` turns: the result as `content` (a mapping or list is JSON-encoded), with the optional
  `tool_call_id` and `name` of the call it answers;
- assistant `reasoning_content`, or a `<think>...</think>` block leading the content (moved to
  reasoning_content, where templates that render reasoning look for it).

What is wrong with the *conversation* (an unknown role, a misplaced turn, no final assistant
turn) is refused: one line naming the row. What is wrong with its *tool use* (a result no call
asked for, a call to a tool the row does not offer, arguments that are not a JSON object) is a
row contract (`TOOL_RULES`, checked with pandera by `tool_contract_failures`): such rows are
dropped and counted under `data.max_dropped_fraction`, as scraped agent data often has a few.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from finetune.errors import PipelineError

#: the roles a parsed message may have (parse_message)
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "system": "system", "tool": "tool",
                  "observation": "tool", "function_call": "assistant"}
#: a thinking block leading an assistant turn's content (DeepSeek-R1, Qwen3, QwQ write them)
THINKING = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)

#: the row contracts of tool use: rule name -> what a dropped row has (after "rows have ...")
TOOL_RULES = {
    "tool_result_answers_a_call": "a tool result without a preceding call",
    "calls_a_listed_tool": "a call to a tool missing from tools",
    "arguments_are_a_json_object": "call arguments that are not a JSON object",
}


# -- parsing -------------------------------------------------------------------------------
def parse(value: Any, where: str) -> list[dict]:
    """A row's messages, in whichever layout the dataset stores them, in the one form the
    rest reads: a list or a JSON string of one, a numpy array (parquet), messages as
    mappings in OpenAI or ShareGPT form. [] when the row has no messages (None, an empty
    list), for `nothing_to_learn` to drop.

    Why one step: everything after it (the order check, the chat template, the loss mask)
    sees one layout, so a new layout or turn kind is added here and nowhere else learns the
    raw forms. A row that is not a conversation is one line naming the row and, where it is
    one message, the message."""
    value = _json_or_value(value, f"{where}: not a list of messages (a string that is not JSON)")
    if hasattr(value, "tolist"):  # a numpy array from parquet
        value = value.tolist()
    if value is None or (isinstance(value, list) and not value):
        return []
    if not isinstance(value, list):
        raise PipelineError(f"{where}: not a list of messages")
    return [parse_message(m, f"{where} message {turn}") for turn, m in enumerate(value)]


def parse_message(m: Any, where: str) -> dict:
    """One message in the normalised form (module docstring); `where` names the row and the
    message. Malformed is refused here; a tool-use fault (arguments that do not parse) is
    kept as written for the row contract to drop the row."""
    m = _plain(m)
    if not isinstance(m, dict):
        raise PipelineError(f"{where}: not a mapping")
    if "role" in m:
        role, content = m.get("role"), m.get("content")
    elif "from" in m:
        role, content = SHAREGPT_ROLES.get(m.get("from"), m.get("from")), m.get("value")
        if m.get("from") == "function_call":  # LLaMA-Factory: the value is the call's JSON
            return {"role": "assistant", "content": "",
                    "tool_calls": _calls(_json_or_value(content, None), where)}
    else:
        raise PipelineError(f"{where}: has neither role/content nor from/value")
    if role not in ROLES:
        raise PipelineError(f"{where}: unknown role {role!r} (system, user, assistant, tool; "
                            "ShareGPT: system, human, gpt, function_call, observation)")
    if role == "tool" and isinstance(content, dict):
        content = json.dumps(content, ensure_ascii=False)
    if hasattr(content, "tolist") and not isinstance(content, str):
        content = content.tolist()  # a list of parts from parquet: a numpy array
    if isinstance(content, list):
        content = content_parts(content, role, where)
    calls = m.get("tool_calls") if role == "assistant" else None
    if content is None and (calls or m.get("reasoning_content")):
        content = ""  # a turn that only calls tools (or only thinks) has no text
    if not isinstance(content, str) and not (isinstance(content, list) and role == "user"):
        raise PipelineError(f"{where}: content is not a string")
    out: dict = {"role": role, "content": content}
    if role == "assistant":
        reasoning = m.get("reasoning_content")
        thinking = THINKING.match(content)
        if thinking and reasoning is None:
            reasoning, out["content"] = thinking.group(1).strip("\n"), content[thinking.end():]
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise PipelineError(f"{where}: reasoning_content is not a string")
            if reasoning.strip():
                out["reasoning_content"] = reasoning
        if calls is not None:
            out["tool_calls"] = _calls(calls, where)
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                out[key] = str(m[key])
    return out


#: the part types a message's content may list (OpenAI's and transformers' form)
PART_TYPES = ("text", "image")


def content_parts(parts: list, role: str, where: str) -> str | list[dict]:
    """A content given as parts ([{"type": "text", "text": ...}, {"type": "image"}]): the
    text alone when no part is an image (what text-only templates read; a tool's list result
    is its JSON, as before), else the parts in the form vision templates read, which only a
    user turn may hold (an image is an input, never trained). Malformed parts: one line."""
    parts = [_plain(part) for part in parts]
    if role == "tool" and not all(isinstance(p, dict) and p.get("type") in PART_TYPES
                                  for p in parts):
        return json.dumps(parts, ensure_ascii=False)  # a tool's structured result
    out = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise PipelineError(f"{where}: content part {i} is not one of "
                                f"{', '.join(PART_TYPES)} ({{\"type\": ...}})")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise PipelineError(f"{where}: content part {i} has no text string")
            out.append({"type": "text", "text": part["text"]})
        else:
            out.append({"type": "image"})
    if not any(p["type"] == "image" for p in out):
        return "".join(p["text"] for p in out)
    if role != "user":
        raise PipelineError(f"{where}: an image in a {role} turn; images are inputs, given "
                            "in user turns")
    return out


def image_count(conv: list[dict]) -> int:
    """How many image parts a normalised conversation holds."""
    return sum(1 for m in conv if isinstance(m["content"], list)
               for p in m["content"] if p["type"] == "image")


def _calls(raw: Any, where: str) -> list[dict]:
    """An assistant turn's tool calls in transformers' form; arguments parsed from a JSON
    string where they are one (else kept as written: the row contract drops the row)."""
    raw = _plain(raw)
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise PipelineError(f"{where}: tool_calls is not a list of calls")
    calls = []
    for i, call in enumerate(raw):
        call = _plain(call)
        if not isinstance(call, dict):
            raise PipelineError(f"{where}: tool call {i} is not a mapping")
        fn = _plain(call.get("function", call))
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise PipelineError(f"{where}: tool call {i} has no function name")
        args = fn.get("arguments", fn.get("parameters", {}))
        args = _plain(args)
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as written: arguments_are_a_json_object drops the row
        out = {"type": "function", "function": {"name": name, "arguments": args}}
        if call.get("id") is not None:
            out["id"] = str(call["id"])
        calls.append(out)
    return calls


def _plain(value: Any) -> Any:
    """A mapping or array from parquet/pyarrow as a plain dict/list."""
    if hasattr(value, "keys") and not isinstance(value, dict):
        return dict(value)
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def _json_or_value(value: Any, error: str | None) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        if error is None:
            return value
        raise PipelineError(error) from None


# -- order and content -----------------------------------------------------------------------
#: which role may follow which (a conversation starts at "start", after an optional system)
FOLLOWS = {"start": ("user",), "user": ("assistant", "tool"), "assistant": ("user", "tool"),
           "tool": ("tool", "assistant")}


def check_order(conv: list[dict], where: str, ends_on: str = "assistant") -> None:
    """Refuse a conversation whose roles are out of order: a system message only first, then
    a user turn; an assistant turn answers a user turn or a tool result; a tool result
    follows a turn (whether a call asked for it is a row contract, not an order); it ends on
    an assistant turn (`ends_on` "user": a prompt, ending on the turn the model answers: a
    user turn or a tool result).

    Why: chat templates are written for that order (many raise on anything else, and the
    others render it in ways the model never saw); the prompt evaluated is everything before
    the last assistant turn, so a conversation must end on one. One line naming the row and
    the first message out of place."""
    head = 1 if conv and conv[0]["role"] == "system" else 0
    previous = "start"
    for turn, m in enumerate(conv[head:], start=head):
        allowed = FOLLOWS[previous]
        if m["role"] not in allowed:
            raise PipelineError(
                f"{where}: message {turn} is {m['role']}, expected {' or '.join(allowed)} "
                "(user and assistant alternate from a user turn, tool results follow the "
                "assistant turn that called the tools; a system message only first)")
        previous = m["role"]
    last = conv[-1]["role"] if len(conv) > head else None
    if ends_on == "user":
        if last not in ("user", "tool"):
            raise PipelineError(f"{where}: the conversation does not end on a user turn (a "
                                "prompt ends on the turn the model answers)")
    elif last != "assistant":
        raise PipelineError(f"{where}: the conversation does not end on an assistant turn")


def nothing_to_learn(conv: list[dict]) -> bool:
    """Whether a (parsed, checked) conversation is dropped and counted rather than trained on:
    no messages, or an assistant turn with nothing in it (no text, no call, no reasoning).

    Why dropped, not refused: such a row is well formed, it only has nothing to teach, or
    would teach the wrong thing (an empty assistant turn trains the model to answer
    nothing); one such row should not stop a run."""
    return not conv or any(
        m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls")
        and not m.get("reasoning_content") for m in conv)


def normalise(value: Any, system_prompt: str | None, where: str) -> list[dict] | None:
    """One row's conversation, checked, in the normalised form; None when it has nothing to
    learn. The steps, in this order (a malformed message is reported before a misplaced one,
    and a malformed conversation is refused even when it would have been dropped): `parse`,
    `data.system_prompt` put first where the row has no system message, `check_order`,
    `nothing_to_learn`."""
    conv = parse(value, where)
    if conv:
        if system_prompt is not None and conv[0]["role"] != "system":
            conv.insert(0, {"role": "system", "content": system_prompt})
        check_order(conv, where)
    return None if nothing_to_learn(conv) else conv


# -- tools -----------------------------------------------------------------------------------
def tool_schemas(value: Any, where: str) -> list[dict]:
    """A tools list (a list or a JSON string of one) in the OpenAI form templates read:
    {"type": "function", "function": {"name", ...}}; a bare {"name", ...} is wrapped."""
    value = _plain(_json_or_value(value, f"{where}: not a list of tools (a string that is "
                                         "not JSON)"))
    if value is None:
        return []
    if not isinstance(value, list):
        raise PipelineError(f"{where}: not a list of tools")
    schemas = []
    for i, schema in enumerate(value):
        schema = _plain(_json_or_value(schema, None))
        fn = schema.get("function", schema) if isinstance(schema, dict) else None
        fn = _plain(fn)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PipelineError(f"{where}: tool {i} has no name (a JSON schema with a name, "
                                "or {type: function, function: {name, ...}})")
        schemas.append({"type": "function", "function": _deep_plain(fn)})
    return schemas


def _deep_plain(value: Any) -> Any:
    value = _plain(value)
    if isinstance(value, dict):
        return {k: _deep_plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_deep_plain(v) for v in value]
    return value


def dataset_tools(data, root: Path) -> list[dict]:
    """`data.tools`: the list, or the .json file holding it (relative to the project)."""
    given = data.tools
    if given is None:
        return []
    if isinstance(given, str):
        path = Path(given) if Path(given).is_absolute() else root / given
        if not path.is_file():
            raise PipelineError(f"data.tools: {given!r} is not a file ({path} not found)")
        try:
            given = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise PipelineError(f"data.tools: {path} is not JSON ({exc.msg}, line "
                                f"{exc.lineno})") from None
    return tool_schemas(given, "data.tools")


def tool_names(tools: list[dict]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def _unanswered_result(conv: list[dict], names: set[str]) -> str | None:
    """A tool result no call asked for: every result answers a call of the assistant turn
    before it (no more results than calls; a tool_call_id names one of the call ids)."""
    pending: list[dict] = []
    for turn, m in enumerate(conv):
        if m["role"] == "assistant":
            pending = list(m.get("tool_calls", ()))
        elif m["role"] == "tool":
            ids = {c["id"] for c in pending if "id" in c}
            answered = m.get("tool_call_id")
            match = next((c for c in pending if answered not in ids
                          or c.get("id") == answered), None)
            if match is None:
                return f"message {turn} answers no call"
            pending.remove(match)
        else:
            pending = []
    return None


def _calls_of(conv: list[dict]):
    for turn, m in enumerate(conv):
        for call in m.get("tool_calls", ()):
            yield turn, call["function"]


def _unlisted_tool(conv: list[dict], names: set[str]) -> str | None:
    """A call to a tool the row does not offer (its tools column, else data.tools)."""
    for turn, fn in _calls_of(conv):
        if fn["name"] not in names:
            return (f"message {turn} calls {fn['name']!r}; tools: "
                    f"{', '.join(sorted(names)) or 'none'}")
    return None


def _arguments_not_an_object(conv: list[dict], names: set[str]) -> str | None:
    """Call arguments that did not parse as a JSON object."""
    for turn, fn in _calls_of(conv):
        if not isinstance(fn["arguments"], dict):
            return f"message {turn} calls {fn['name']!r} with {fn['arguments']!r}"
    return None


#: each TOOL_RULES rule's check: (conversation, tool names) -> what breaks it, or None
RULE_CHECKS = {"tool_result_answers_a_call": _unanswered_result,
               "calls_a_listed_tool": _unlisted_tool,
               "arguments_are_a_json_object": _arguments_not_an_object}


def tool_fault(conv: list[dict], tools: list[dict]) -> str | None:
    """The first TOOL_RULES rule a conversation breaks, with what breaks it, as the count's
    message gives it; None when its tool use is sound (one row: no frame to check)."""
    names = tool_names(tools)
    for rule, check in RULE_CHECKS.items():
        detail = check(conv, names)
        if detail is not None:
            return f"{TOOL_RULES[rule]} ({detail})"
    return None


def tool_contract_failures(conversations: dict[int, list[dict]],
                           tools: dict[int, list[dict]]) -> dict[int, tuple[str, str]]:
    """Row number -> (the first TOOL_RULES rule it breaks, what breaks it) for the rows whose
    tool use is unsound. The contract is a pandera schema over the rows that use tools, one
    named check per rule on each (conversation, tool names) element; its failure cases name
    the rows and rules."""
    import pandas as pd
    import pandera.pandas as pa

    rows = [r for r, conv in conversations.items()
            if any(m["role"] == "tool" or m.get("tool_calls") for m in conv)]
    if not rows:
        return {}
    elements = pd.Series([(conversations[r], tool_names(tools[r])) for r in rows], index=rows,
                         dtype=object)
    checks = [pa.Check(lambda e, fn=fn: fn(*e) is None, element_wise=True, name=rule)
              for rule, fn in RULE_CHECKS.items()]
    schema = pa.DataFrameSchema({"tool_use": pa.Column(object, checks)}, name="tool use")
    try:
        schema.validate(pd.DataFrame({"tool_use": elements}), lazy=True)
    except pa.errors.SchemaErrors as exc:
        cases = exc.failure_cases.dropna(subset=["index"])
        broken: dict[int, tuple[str, str]] = {}
        order = list(RULE_CHECKS)
        for row, rule in sorted(zip(cases["index"].astype(int), cases["check"]),
                                key=lambda rc: (rc[0], order.index(rc[1]))):
            if row not in broken:
                broken[row] = (rule, RULE_CHECKS[rule](*elements[row]))
        return broken
    return {}
