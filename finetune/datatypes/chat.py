"""`chat`: conversations rendered with a chat template, trained on the assistant turns.

Rows hold a list of messages (finetune.datatypes.conversation: OpenAI or ShareGPT form, with
tool calls, tool results and reasoning), and the tools each row offers (a `tools` column, or
`data.tools` for the dataset). The format step checks and normalises the conversations, drops
and counts those with nothing to learn or unsound tool use (a row contract), and renders for
evaluation the prompt up to the last assistant turn and up to each turn that calls tools;
tokenization renders the whole conversation and trains each trained turn as the template
renders it (finetune.datatypes.turns: roles_to_train, train_on_eos, train_on_reasoning,
last_turn_only). A template that cannot mark the turns (its rendering of a conversation does
not start with its rendering of the first turns) is one line, naming the row.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.datatypes.base import DataContext, DatasetType, Formatted
from finetune.datatypes.conversation import (  # noqa: F401 (the conversational types' API)
    ROLES, SHAREGPT_ROLES, TOOL_RULES, check_order, dataset_tools, image_count, normalise,
    nothing_to_learn, parse, parse_message, tool_contract_failures, tool_schemas)
from finetune.datatypes.encoding import IGNORE_INDEX, add_row, empty_encoding
from finetune.datatypes.turns import MaskRules, end_of_turn, render, sequences, token_mask
from finetune.errors import PipelineError

FIELDS = ("messages", "conversations")


class ChatType(DatasetType):
    name = "chat"
    aliases = ("conversational", "sharegpt")  # TRL's and Axolotl's names
    keys = ("messages_field", "chat_template", "system_prompt", "assistant_only_loss",
            "last_turn_only", "roles_to_train", "train_on_eos", "train_on_reasoning", "tools",
            "tools_field")
    #: whether a user turn may hold image parts (the vision_chat type's rows)
    takes_images = False

    def check(self) -> None:
        d = self.data
        if d.last_turn_only and not d.assistant_only_loss:
            raise ValueError("last_turn_only needs assistant_only_loss: true")
        if not d.assistant_only_loss:
            for key, default in (("roles_to_train", ["assistant"]), ("train_on_eos", True),
                                 ("train_on_reasoning", True)):
                if getattr(d, key) != default:
                    raise ValueError(f"{key} needs assistant_only_loss: true (false trains "
                                     "every token but tool results)")
        if d.last_turn_only and list(d.roles_to_train) != ["assistant"]:
            raise ValueError("last_turn_only trains the last assistant turn alone; "
                             "roles_to_train must be [assistant]")

    def prepare(self, ctx: DataContext) -> None:
        chat_template(self.data, ctx.tokenizer, ctx.root)  # a template file: read here
        dataset_tools(self.data, ctx.root)

    def required_columns(self) -> list[str]:
        return [self.data.messages_field] if self.data.messages_field else []

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """Formatted rows: the checked conversation and its tools (JSON); for evaluation the
        prompt up to the last assistant turn with the generation prompt and that turn's
        content, and each turn that calls tools with its prompt (`tool_turns`)."""
        import pandas as pd

        field = messages_field(frame, self.data, split)
        tools_of = row_tools(frame, self.data, split, ctx.root)
        tok, template = ctx.tokenizer, chat_template(self.data, ctx.tokenizer, ctx.root)
        # generation prompts get BOS from the evaluate stage where the tokenizer adds one
        strip_bos = tok.bos_token if ctx.bos is not None else None

        def prompt_of(messages, tools):
            text = render(tok, template, messages, generation_prompt=True, tools=tools)
            return text[len(strip_bos):] if strip_bos and text.startswith(strip_bos) else text

        convs, tools, dropped = {}, {}, []
        for i, (value, row_tools_) in enumerate(zip(frame[field].tolist(), tools_of),
                                                start=first_row):
            conv = normalise(value, self.data.system_prompt,
                             f"split '{split}' row {i} column '{field}'")
            if conv and not self.takes_images and image_count(conv):
                raise PipelineError(f"split '{split}' row {i} column '{field}': an image part; "
                                    f"data.dataset_type {self.name} trains text alone (images "
                                    "and text: vision_chat)")
            if conv is None:
                dropped.append(i)
                continue
            convs[i], tools[i] = conv, row_tools_
        faults = tool_contract_failures(convs, tools)
        reasons = {i: "no messages or an empty assistant turn" for i in dropped}
        for i, (rule, detail) in faults.items():
            reasons[i] = f"{TOOL_RULES[rule]} ({detail})"
            del convs[i]
        rows = {"prompt": [], "completion": [], "messages": [], "tools": [], "tool_turns": []}
        for i, conv in convs.items():
            last = conv[-1]
            rows["messages"].append(json.dumps(conv, ensure_ascii=False))
            rows["tools"].append(json.dumps(tools[i], ensure_ascii=False))
            rows["prompt"].append(prompt_of(conv[:-1], tools[i]))
            rows["completion"].append(last["content"] if last["content"].strip()
                                      else json.dumps(calls_of(last), ensure_ascii=False))
            rows["tool_turns"].append(json.dumps(
                [{"prompt": prompt_of(conv[:t], tools[i]), "calls": calls_of(m)}
                 for t, m in enumerate(conv) if m.get("tool_calls")], ensure_ascii=False))
        return Formatted.with_reasons(pd.DataFrame(rows), reasons)

    def eval_rows(self, formatted):
        """One row per held-out conversation (its last turn's text as the reference) and one
        per turn that calls tools (the calls as the reference: a list, which `score` tells
        apart), in conversation order."""
        import pandas as pd

        prompts, references = [], []
        for prompt, completion, messages, turns in zip(
                formatted["prompt"], formatted["completion"], formatted["messages"],
                formatted.get("tool_turns", [None] * len(formatted))):
            for turn in json.loads(turns) if turns else []:
                prompts.append(turn["prompt"])
                references.append(turn["calls"])
            if not json.loads(messages)[-1].get("tool_calls"):
                prompts.append(prompt)
                references.append(completion)
        return pd.DataFrame({"prompt": prompts, "reference": references})

    def reported_metrics(self) -> tuple[str, ...]:
        from finetune.datatypes.tool_calls import TOOL_CALL_KEYS

        return (*super().reported_metrics(), *TOOL_CALL_KEYS)

    def row_scores(self, predictions: list, references: list, ev, ctx: DataContext
                   ) -> dict[str, list[float]]:
        """Text rows with the generation metrics; tool-call rows (eval.generation_metrics
        `tool_calls`) by the calls parsed from the generation: name and arguments. Each
        metric's values cover its own rows."""
        from finetune.datatypes.tool_calls import tool_call_rows

        calls = [i for i, r in enumerate(references) if isinstance(r, list)]
        texts = [i for i, r in enumerate(references) if not isinstance(r, list)]
        rows = {}
        if texts:
            rows.update(super().row_scores([predictions[i] for i in texts],
                                           [references[i] for i in texts], ev, ctx))
        if calls and "tool_calls" in ev.generation_metrics:
            rows.update(tool_call_rows([predictions[i] for i in calls],
                                       [references[i] for i in calls]))
        return rows

    def serving_chat_template(self, tok, root: Path) -> str | None:
        return chat_template(self.data, tok, root)

    def encoder(self, ctx: DataContext):
        d = self.data
        template = chat_template(d, ctx.tokenizer, ctx.root)
        return encode_chat_batch, {
            "template": template, "bos": ctx.bos, "max_len": d.max_seq_length,
            "roles": list(d.roles_to_train) if d.assistant_only_loss else None,
            "last_only": d.last_turn_only, "eos": d.train_on_eos,
            "reasoning": d.train_on_reasoning}


def calls_of(message: dict) -> list[dict]:
    """An assistant turn's calls as {name, arguments}: what evaluation compares."""
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message.get("tool_calls", ())]


#: the row column that names a row's environment when the method's environments are a mapping
#: (grpo.environment_factory as {name: class}; TRL's name)
ENVIRONMENT_COLUMN = "environment"


def row_tools(frame, data, split: str, root: Path,
              method_tools: list[dict] | dict[str, list[dict]] | None = None,
              first_row: int = 0) -> list[list[dict]]:
    """Each row's tools: its tools column (`data.tools_field`, else `tools` when the split
    has one) where not null, else `data.tools`, else the method's (`method_tools`: the
    functions a rollout calls, DataContext.tools; per environment name when the method's
    environments are a mapping, chosen by the row's `environment` column: a row naming none of
    them is one line). `first_row`: the number of the frame's first row in its split."""
    if isinstance(method_tools, dict):
        shared = per_row_environment_tools(frame, method_tools, split, first_row)
    else:
        shared = [dataset_tools(data, root) or list(method_tools or [])] * len(frame)
    column = data.tools_field
    if column and column not in frame.columns:
        raise PipelineError(f"data.tools_field '{column}' is not a column of split '{split}' "
                            f"(columns: {', '.join(map(str, frame.columns))})")
    column = column or ("tools" if "tools" in frame.columns else None)
    if column is None:
        return shared
    out = []
    for i, value in enumerate(frame[column].tolist()):
        missing = value is None or (isinstance(value, float) and value != value)
        out.append(shared[i] if missing else tool_schemas(
            value, f"split '{split}' row {first_row + i} column '{column}'"))
    return out


def per_row_environment_tools(frame, by_name: dict[str, list[dict]], split: str,
                              first_row: int = 0) -> list[list[dict]]:
    """The tools of each row's environment, named by its `environment` column."""
    known = ", ".join(map(str, by_name))
    if ENVIRONMENT_COLUMN not in frame.columns:
        raise PipelineError(f"split '{split}' has no '{ENVIRONMENT_COLUMN}' column; "
                            "grpo.environment_factory is a mapping, so each row names one of "
                            f"its environments ({known})")
    out = []
    for i, name in enumerate(frame[ENVIRONMENT_COLUMN].tolist()):
        if not isinstance(name, str) or name not in by_name:
            raise PipelineError(f"split '{split}' row {first_row + i} column "
                                f"'{ENVIRONMENT_COLUMN}': {name!r} is none of "
                                f"grpo.environment_factory's environments ({known})")
        out.append(by_name[name])
    return out


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


def assistant_spans(tok, template: str, conv: list[dict], where: str,
                    tools: list[dict] | None = None) -> tuple[str, list]:
    """The rendered conversation and the [start, end) characters of each assistant turn
    (the default rules' mask of a template that renders every turn the same way)."""
    seqs = sequences(tok, template, conv, tools, MaskRules(), where)
    return seqs[0].text, seqs[0].trained


def encode_chat_batch(batch: dict[str, list], tok, template: str, bos: int | None,
                      max_len: int, roles: list[str] | None = ("assistant",),
                      last_only: bool = False, eos: bool = True, reasoning: bool = True
                      ) -> dict[str, list]:
    """The tokenize map function for chat rows: each row's training sequences
    (finetune.datatypes.turns; usually one, more where the template renders a past turn
    differently) with their labels. `roles` None: every token but tool results."""
    rules = MaskRules(tuple(roles) if roles is not None else None, last_only, eos, reasoning)
    marker = end_of_turn(tok, template) if not eos else None
    tools_column = batch.get("tools") or [None] * len(batch["messages"])
    out = empty_encoding()
    for i, (text, tools) in enumerate(zip(batch["messages"], tools_column)):
        conv, tools = json.loads(text), json.loads(tools) if tools else None
        for seq in sequences(tok, template, conv, tools, rules, f"row {i}", marker):
            enc = tok(seq.text, add_special_tokens=False, return_offsets_mapping=True)
            head = ([bos] if bos is not None and not seq.text.startswith(tok.bos_token or "\0")
                    else [])
            trained = token_mask(enc["offset_mapping"], seq.char_mask())
            ids = enc["input_ids"]
            labels = [IGNORE_INDEX] * len(head) + [
                t if keep else IGNORE_INDEX for t, keep in zip(ids, trained.tolist())]
            add_row(out, head + ids, labels, max_len)
    return out
