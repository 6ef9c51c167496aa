"""`prompt`: rows that hold a prompt only, for a method that makes the completions itself
(`training.type: grpo`: completions are sampled during training and scored by reward functions).

The prompt is either a string rendered from the row's columns (`prompt_template` /
`prompt_func`, as the completion type renders one), or TRL's layout: a `prompt` column holding a
string or a conversation (a list of role/content messages ending on a user turn), which the chat
template (`chat_template`, else the tokenizer's) renders with its generation prompt,
`system_prompt` put first where it has no system message.

No token is trained (`targets = "none"`): a tokenized row is the prompt's tokens (BOS as the
other types add it), every label IGNORE_INDEX. A prompt longer than `max_seq_length` keeps its
BOS and its last tokens (`keep_prompt_end`), and is flagged `truncated` (counted in
tokenize.json): the end is the question and the chat template's generation prompt, which the
model continues from; cut there (as the other types cut their rows, at the end), it would
continue the user's text instead of answering (TRL's max_prompt_length kept the end too).

The reward functions (TRL's `f(prompts, completions, **columns)`) need the rest of the row (a
GSM8K `answer`): each formatted and tokenized row carries `reward_inputs`, a JSON object (sorted
keys) of `prompt` (the prompt as a reward function sees it: the rendered string, or the message
list of a conversation, system message included) and every other raw column of the row. The
completion column (`completion_template` / `completion_func`, else empty) is only the evaluate
stage's reference: rows are never dropped for an empty one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from finetune.datatypes.base import DataContext, DatasetType, Formatted
from finetune.datatypes.chat import chat_template, check_order, parse, render, row_tools
from finetune.datatypes.conversation import dataset_tools, tool_fault
from finetune.datatypes.encoding import IGNORE_INDEX, add_row, empty_encoding, token_ids
from finetune.datatypes.rows import (TEMPLATE_KEYS, builder, check_exclusive_templates,
                                     template_columns)
from finetune.datatypes.rows import render as render_rows
from finetune.errors import PipelineError

#: TRL's prompt column
PROMPT = "prompt"
#: the column of reward-function inputs, formatted and tokenized (a JSON object per row)
REWARD_INPUTS = "reward_inputs"


class PromptType(DatasetType):
    name = "prompt"
    keys = TEMPLATE_KEYS + ("input_columns", "chat_template", "system_prompt", "tools",
                            "tools_field")
    targets = "none"
    trainer_hint = ("holds prompts only (the method generates the completions and reward "
                    "functions score them; sft has no completion to train on); set "
                    "training.type: grpo")

    @property
    def templated(self) -> bool:
        """The prompt is rendered from the row's columns (else: the `prompt` column)."""
        return self.data.prompt_template is not None or bool(self.data.prompt_func)

    def check(self) -> None:
        d = self.data
        check_exclusive_templates(d)
        if self.templated:
            # these render a conversation; a templated prompt is a string, so they would be unused
            key = "prompt_template" if d.prompt_template is not None else "prompt_func"
            for chat_key in ("chat_template", "system_prompt", "tools", "tools_field"):
                if getattr(d, chat_key) is not None:
                    raise ValueError(
                        f"{chat_key} renders a conversation in the 'prompt' column; {key} "
                        f"renders a string prompt, which it would not apply to: remove one")

    def prepare(self, ctx: DataContext) -> None:
        for part in ("prompt", "completion"):
            builder(self.data, part)  # a function by reference: imported and checked here
        if self.data.chat_template:
            chat_template(self.data, ctx.tokenizer, ctx.root)  # a template file: read here
        dataset_tools(self.data, ctx.root)
        ctx.tools  # the method's tools (grpo.tools): each loads and has a schema, or one line

    def required_columns(self) -> list[str]:
        d = self.data
        return list(dict.fromkeys(([] if self.templated else [PROMPT])
                                  + template_columns(d)))

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """Rows of prompt (the text the model is prompted with), completion (the evaluate
        stage's reference, may be empty) and reward_inputs; a row whose prompt is empty is
        dropped and counted."""
        import pandas as pd

        if not self.templated and PROMPT not in frame.columns:
            raise PipelineError(
                f"dataset_type prompt: split '{split}' has no 'prompt' column (columns: "
                f"{', '.join(map(str, frame.columns))}); set data.prompt_template or "
                "data.prompt_func to render one")
        fns = {"completion": builder(self.data, "completion")}
        if self.templated:
            fns["prompt"] = builder(self.data, "prompt")
        texts = render_rows(frame, fns, split, first_row)
        chat = _Conversations(self.data, ctx)
        tools = None if self.templated else row_tools(frame, self.data, split, ctx.root,
                                                      ctx.tools, first_row)
        out: dict[str, list] = {"prompt": [], "completion": [], REWARD_INPUTS: []}
        reasons: dict[int, str] = {}
        for offset, row in enumerate(frame.to_dict("records")):
            i = first_row + offset
            if self.templated:
                text = seen = texts["prompt"][offset]
            else:
                text, seen = chat.prompt(row[PROMPT], f"split '{split}' row {i} column 'prompt'",
                                         tools[offset])
            if isinstance(text, Fault):
                reasons[i] = text.why
                continue
            if text is None or not text.strip():
                reasons[i] = "an empty prompt"
                continue
            others = {str(c): v for c, v in row.items() if c != PROMPT}
            out["prompt"].append(text)
            out["completion"].append(texts["completion"][offset])
            out[REWARD_INPUTS].append(reward_json({**others, PROMPT: seen}, split, i))
        return Formatted.with_reasons(pd.DataFrame(out), reasons)

    def formatted_schema(self):
        """prompt non-empty, completion any string (a reference only), reward_inputs JSON."""
        import pandera.pandas as pa

        from finetune.datatypes.contract import non_empty_text

        return pa.DataFrameSchema(
            {"prompt": pa.Column(str, [non_empty_text()], nullable=False),
             "completion": pa.Column(str, nullable=False),
             REWARD_INPUTS: pa.Column(str, nullable=False)},
            strict=False, name="formatted")

    def encoder(self, ctx: DataContext):
        return encode_prompts, {"bos": ctx.bos, "max_len": self.data.max_seq_length}

    def examples(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> list[dict]:
        """Every prompt (none trains a token), with its reward inputs."""
        formatted = self.format(frame, split, ctx, first_row)
        fn, kwargs = self.encoder(ctx)
        enc = fn(formatted.rows.to_dict("list"), tok=ctx.tokenizer, **kwargs)
        return [{"input_ids": ids, "labels": labels, REWARD_INPUTS: inputs}
                for ids, labels, inputs in zip(enc["input_ids"], enc["labels"],
                                               enc[REWARD_INPUTS])]

    def prompt_encoder(self, ctx: DataContext):
        """prompt (a conversation), tools -> its ids as the format and tokenize stages make
        them: the rollout's rendering of a prompt an environment's first observation changed
        (engine.rollout.episodes)."""
        chat = _Conversations(self.data, ctx)

        def encode(prompt: list[dict], tools: list[dict] | None) -> list[int]:
            text, _ = chat.prompt(prompt, "an environment's prompt", tools)
            if not isinstance(text, str) or not text.strip():
                why = text.why if isinstance(text, Fault) else "it is empty"
                raise PipelineError(f"an environment's prompt cannot be rendered: {why}")
            head = ([ctx.bos] if ctx.bos is not None else []) + token_ids(ctx.tokenizer,
                                                                          [text])[0]
            return keep_prompt_end(head, ctx.bos, self.data.max_seq_length)

        return encode

    def serving_chat_template(self, tok, root) -> str | None:
        return chat_template(self.data, tok, root) if self.data.chat_template else None


@dataclass(frozen=True)
class Fault:
    """Why a conversational prompt is dropped: its tool use breaks a row contract."""

    why: str


class _Conversations:
    """TRL-layout prompts of one format call: the template and the tokenizer loaded on the
    first conversation (a string prompt needs neither)."""

    def __init__(self, data, ctx: DataContext):
        self.data, self.ctx, self.template = data, ctx, None

    def prompt(self, value: Any, where: str, tools: list[dict] | None = None
               ) -> tuple[str | Fault | None, Any]:
        """(the text the model is prompted with, the prompt a reward function sees); (None,
        None) for a row with no prompt, (Fault, None) for one whose tool use breaks a row
        contract (both dropped and counted)."""
        if isinstance(value, str):
            return value, value
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return None, None
        if not (isinstance(value, (list, tuple)) or hasattr(value, "tolist")):
            raise PipelineError(f"{where}: a prompt is a string or a list of messages, got "
                                f"{type(value).__name__}")
        conv = parse(list(value) if isinstance(value, tuple) else value, where)
        if not conv:
            return None, None
        if self.data.system_prompt is not None and conv[0]["role"] != "system":
            conv.insert(0, {"role": "system", "content": self.data.system_prompt})
        check_prompt_order(conv, where)
        fault = tool_fault(conv, tools or [])
        if fault is not None:
            return Fault(fault), None
        tok = self.ctx.tokenizer
        if self.template is None:
            self.template = chat_template(self.data, tok, self.ctx.root)
        text = render(tok, self.template, conv, generation_prompt=True, tools=tools)
        # the encoder adds BOS as a token where the tokenizer adds one
        if self.ctx.bos is not None and tok.bos_token and text.startswith(tok.bos_token):
            text = text[len(tok.bos_token):]
        return text, conv


def check_prompt_order(conv: list[dict[str, str]], where: str) -> None:
    """chat.check_order's rule for a prompt: it ends on a user turn, the one the model
    answers."""
    check_order(conv, where, ends_on="user")


def reward_json(columns: dict[str, Any], split: str, row: int) -> str:
    """The reward inputs of one row as a JSON object (sorted keys); a value JSON cannot hold
    is one line naming split, row and column."""
    plain = {}
    for column, value in columns.items():
        try:
            plain[column] = _plain(value)
        except (TypeError, ValueError) as exc:
            raise PipelineError(
                f"split '{split}' row {row} column '{column}': {exc}; reward functions get the "
                "row's columns as JSON (strings, numbers, booleans, lists, mappings)") from None
    return json.dumps(plain, sort_keys=True, ensure_ascii=False, allow_nan=False)


def _plain(value: Any) -> Any:
    """`value` as JSON's types: numpy scalars and arrays (parquet) as Python's, a missing
    value (NaN, pandas' NA) as null; anything else is a TypeError (a ValueError: infinity)."""
    import numpy as np
    import pandas as pd

    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            raise ValueError(f"{value} is not a JSON number")
        return value
    if isinstance(value, (np.datetime64, np.timedelta64)):
        raise TypeError(f"{type(value).__name__} is not JSON-able")
    if isinstance(value, (np.generic, np.ndarray)):
        return _plain(value.tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a mapping with keys that are not strings is not JSON-able")
        return {k: _plain(v) for k, v in value.items()}
    if value is pd.NA or value is pd.NaT:
        return None
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def keep_prompt_end(ids: list[int], bos: int | None, max_len: int) -> list[int]:
    """`ids` (BOS first where `bos` is not None) cut to `max_len` tokens from the left: BOS and
    the last tokens, where the prompt's question and generation prompt are."""
    if len(ids) <= max_len:
        return ids
    if bos is None or max_len < 2:
        return ids[len(ids) - max_len:]
    return [bos] + ids[len(ids) - max_len + 1:]


def encode_prompts(batch: dict[str, list], tok, bos: int | None, max_len: int
                   ) -> dict[str, list]:
    """The tokenize map function: each prompt's tokens (BOS first where the tokenizer adds
    one), no label trained, its end kept when longer than `max_len` (`keep_prompt_end`,
    flagged truncated); the reward inputs passed through."""
    out = empty_encoding()
    for ids in token_ids(tok, list(batch["prompt"])):
        head = ([bos] if bos is not None else []) + ids
        kept = keep_prompt_end(head, bos, max_len)
        add_row(out, kept, [IGNORE_INDEX] * len(kept), max_len)
        out["truncated"][-1] = len(head) > max_len
    out[REWARD_INPUTS] = list(batch[REWARD_INPUTS])
    return out
