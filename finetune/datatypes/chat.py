"""`chat`: conversations rendered with a chat template, trained on the assistant turns.

Rows hold a list of messages, OpenAI style (`role`/`content`, column `messages`) or ShareGPT
(`from`/`value`, column `conversations`; `human` -> user, `gpt` -> assistant). The format step
checks and normalises them (roles, order, a conversation ending on an assistant turn) and
renders, for evaluation, the prompt up to the last assistant turn with the template's
generation prompt; tokenization renders the whole conversation. A conversation with nothing to
learn (no messages, or an empty assistant turn) is dropped and counted.

The loss mask comes from the template's own rendering, not from searching for the response
text: for each assistant turn the conversation is rendered up to the turn with the generation
prompt and up to the end of the turn; the characters between are the turn, end-of-turn marker
included (so the model learns to stop), and the tokens that overlap them are trained
(character offsets of the fast tokenizer). A template whose rendering of a conversation does
not start with its rendering of the conversation's first turns cannot mark the turns that way:
one line, naming the row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.datatypes.base import DataContext, DatasetType, Formatted
from finetune.datatypes.encoding import IGNORE_INDEX, add_row, empty_encoding
from finetune.errors import PipelineError

FIELDS = ("messages", "conversations")
#: the roles a parsed message may have (parse_message)
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "system": "system"}


class ChatType(DatasetType):
    name = "chat"
    aliases = ("conversational", "sharegpt")  # TRL's and Axolotl's names
    keys = ("messages_field", "chat_template", "system_prompt", "assistant_only_loss",
            "last_turn_only")

    def check(self) -> None:
        if self.data.last_turn_only and not self.data.assistant_only_loss:
            raise ValueError("last_turn_only needs assistant_only_loss: true")

    def prepare(self, ctx: DataContext) -> None:
        chat_template(self.data, ctx.tokenizer, ctx.root)  # a template file: read here

    def required_columns(self) -> list[str]:
        return [self.data.messages_field] if self.data.messages_field else []

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """Formatted rows: the checked conversation (JSON), and for evaluation the prompt up to
        the last assistant turn with the generation prompt and that turn's content."""
        import pandas as pd

        field = messages_field(frame, self.data, split)
        tok, template = ctx.tokenizer, chat_template(self.data, ctx.tokenizer, ctx.root)
        # generation prompts get BOS from the evaluate stage where the tokenizer adds one
        strip_bos = tok.bos_token if ctx.bos is not None else None
        messages, prompts, completions, dropped = [], [], [], []
        for i, value in enumerate(frame[field].tolist(), start=first_row):
            conv = normalise(value, self.data.system_prompt,
                             f"split '{split}' row {i} column '{field}'")
            if conv is None:
                dropped.append(i)
                continue
            messages.append(json.dumps(conv, ensure_ascii=False))
            prompt = render(tok, template, conv[:-1], generation_prompt=True)
            if strip_bos and prompt.startswith(strip_bos):
                prompt = prompt[len(strip_bos):]
            prompts.append(prompt)
            completions.append(conv[-1]["content"])
        rows = pd.DataFrame({"prompt": prompts, "completion": completions, "messages": messages})
        return Formatted(rows, dropped, "no messages or an empty assistant turn")

    def serving_chat_template(self, tok, root: Path) -> str | None:
        return chat_template(self.data, tok, root)

    def encoder(self, ctx: DataContext):
        d = self.data
        return encode_chat_batch, {
            "template": chat_template(d, ctx.tokenizer, ctx.root), "bos": ctx.bos,
            "max_len": d.max_seq_length, "assistant_only": d.assistant_only_loss,
            "last_only": d.last_turn_only}


def messages_field(frame, data, split: str) -> str:
    """`data.messages_field`, else `messages`, else `conversations`."""
    if data.messages_field:
        if data.messages_field not in frame.columns:
            raise PipelineError(f"data.messages_field '{data.messages_field}' is not a column of "
                                f"split '{split}' (columns: {', '.join(map(str, frame.columns))})")
        return data.messages_field
    found = next((f for f in FIELDS if f in frame.columns), None)
    if found is None:
        raise PipelineError(f"dataset_type chat: split '{split}' has no 'messages' or "
                            f"'conversations' column (columns: "
                            f"{', '.join(map(str, frame.columns))}); set data.messages_field")
    return found


def normalise(value: Any, system_prompt: str | None, where: str) -> list[dict[str, str]] | None:
    """One row's conversation as [{role, content}], checked: an optional system message first,
    then user and assistant alternating from a user turn, ending on an assistant turn. None
    when it has nothing to learn: no messages, or an assistant turn that is empty or
    whitespace only (training on it would teach the model to answer nothing).

    The three steps, in this order (a malformed message is reported before a misplaced one,
    and a malformed conversation is refused even when it would have been dropped): `parse`,
    `data.system_prompt` put first where the row has no system message, `check_order`,
    `nothing_to_learn`."""
    conv = parse(value, where)
    if conv:
        if system_prompt is not None and conv[0]["role"] != "system":
            conv.insert(0, {"role": "system", "content": system_prompt})
        check_order(conv, where)
    return None if nothing_to_learn(conv) else conv


def parse(value: Any, where: str) -> list[dict[str, str]]:
    """A row's messages, in whichever layout the dataset stores them, as [{role, content}]:
    a list or a JSON string of one, a numpy array (parquet), messages as mappings in OpenAI
    (`role`/`content`) or ShareGPT (`from`/`value`) form. [] when the row has no messages (None,
    an empty list), for `nothing_to_learn` to drop.

    Why one step: everything after it (the order check, the chat template, the loss mask) sees
    one layout, so a new layout or a new turn kind (tool calls, tool results, reasoning
    content) is added here, in `parse_message`, and nowhere else learns the raw forms. A row
    that is not a conversation is one line naming the row and, where it is one message, the
    message."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise PipelineError(f"{where}: not a list of messages (a string that is not JSON)"
                                ) from None
    if hasattr(value, "tolist"):  # a numpy array from parquet
        value = value.tolist()
    if value is None or (isinstance(value, list) and not value):
        return []
    if not isinstance(value, list):
        raise PipelineError(f"{where}: not a list of messages")
    return [parse_message(m, f"{where} message {turn}") for turn, m in enumerate(value)]


def parse_message(m: Any, where: str) -> dict[str, str]:
    """One message as {role, content}; `where` names the row and the message. The role is one
    of ROLES (ShareGPT's names mapped by SHAREGPT_ROLES) and the content a string. A new turn
    kind adds its role to ROLES (and the order `check_order` allows for it) and its fields
    to what this returns."""
    m = dict(m) if hasattr(m, "keys") else m
    if not isinstance(m, dict):
        raise PipelineError(f"{where}: not a mapping")
    if "role" in m:
        role, content = m.get("role"), m.get("content")
    elif "from" in m:
        role, content = SHAREGPT_ROLES.get(m.get("from"), m.get("from")), m.get("value")
    else:
        raise PipelineError(f"{where}: has neither role/content nor from/value")
    if role not in ROLES:
        raise PipelineError(f"{where}: unknown role {role!r} (system, user, assistant; "
                            "ShareGPT: system, human, gpt)")
    if not isinstance(content, str):
        raise PipelineError(f"{where}: content is not a string")
    return {"role": role, "content": content}


def check_order(conv: list[dict[str, str]], where: str, ends_on: str = "assistant") -> None:
    """Refuse a conversation whose roles are out of order: a system message only first, then
    user and assistant alternating from a user turn, ending on an assistant turn (`ends_on`
    "user": a prompt, ending on the turn the model answers).

    Why: chat templates are written for that order (many raise on anything else, and the
    others render it in ways the model never saw); the prompt evaluated is everything before
    the last assistant turn, so a conversation must end on one; and the loss mask trains the
    assistant turns, each the answer to the user turn before it. One line naming the row and
    the first message out of place."""
    head = 1 if conv and conv[0]["role"] == "system" else 0
    body = conv[head:]
    for turn, m in enumerate(body):
        expected = "user" if turn % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise PipelineError(f"{where}: message {turn + head} is {m['role']}, expected "
                                f"{expected} (user and assistant alternate from a user turn; a "
                                "system message only first)")
    if not body or body[-1]["role"] != ends_on:
        if ends_on == "user":
            raise PipelineError(f"{where}: the conversation does not end on a user turn (a "
                                "prompt ends on the turn the model answers)")
        raise PipelineError(f"{where}: the conversation does not end on an assistant turn")


def nothing_to_learn(conv: list[dict[str, str]]) -> bool:
    """Whether a (parsed, checked) conversation is dropped and counted rather than trained on:
    no messages, or an assistant turn that is empty or whitespace only.

    Why dropped, not refused: such a row is well formed, it only has nothing to teach (no
    messages), or would teach the wrong thing (an empty assistant turn trains the model to
    answer nothing); one such row should not stop a run. The format step drops these and
    reports how many."""
    return not conv or any(m["role"] == "assistant" and not m["content"].strip()
                           for m in conv)


def chat_template(data, tok, root: Path) -> str:
    """`data.chat_template` (a Jinja string, or a file relative to the project), else the
    tokenizer's own; none is one line."""
    given = data.chat_template
    if given:
        if "{{" in given or "{%" in given:
            return given
        path = Path(given) if Path(given).is_absolute() else root / given
        if not path.is_file():
            raise PipelineError(f"data.chat_template: {given!r} is neither a Jinja template "
                                f"(no {{{{ or {{%) nor a file ({path} not found)")
        return path.read_text()
    if getattr(tok, "chat_template", None):
        return tok.chat_template
    raise PipelineError("data.chat_template: the tokenizer has no chat template; set "
                        "data.chat_template to a Jinja string or a .jinja file")


def render(tok, template: str, messages: list[dict], generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=generation_prompt)


def assistant_spans(tok, template: str, conv: list[dict], where: str) -> tuple[str, list]:
    """The rendered conversation and the [start, end) characters of each assistant turn."""
    full = render(tok, template, conv)
    spans = []
    for turn, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = render(tok, template, conv[:turn], generation_prompt=True)
        through = render(tok, template, conv[:turn + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise PipelineError(
                f"data.chat_template cannot mark assistant turns in {where} (turn {turn}): the "
                "rendering of the whole conversation does not start with the rendering of its "
                "first turns; use a template that renders earlier turns the same way")
        spans.append((len(before), len(through)))
    return full, spans


def encode_chat_batch(batch: dict[str, list], tok, template: str, bos: int | None,
                      max_len: int, assistant_only: bool, last_only: bool) -> dict[str, list]:
    """The tokenize map function for chat rows. `assistant_only`: train the assistant turns
    (else every token); `last_only`: only the last assistant turn."""
    out = empty_encoding()
    for i, text in enumerate(batch["messages"]):
        full, spans = assistant_spans(tok, template, json.loads(text), f"row {i}")
        if last_only:
            spans = spans[-1:]
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        head = [bos] if bos is not None and not full.startswith(tok.bos_token or "\0") else []
        if assistant_only:
            # a token overlapping a turn is trained: a word piece may carry the space before
            # the turn's first word ("Assistant: It" -> "▁It")
            trained = [any(start < e and end > s for s, e in spans)
                       for start, end in enc["offset_mapping"]]
        else:
            trained = [True] * len(enc["input_ids"])
        labels = [IGNORE_INDEX] * len(head) + [t if keep else IGNORE_INDEX
                                               for t, keep in zip(enc["input_ids"], trained)]
        add_row(out, head + enc["input_ids"], labels, max_len)
    return out
