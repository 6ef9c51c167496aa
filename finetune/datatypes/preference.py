"""`preference`: pairs of a prompt, a chosen and a rejected completion, for `training.type: dpo`.

Rows come in TRL's two layouts:
- strings: `prompt`, `chosen` and `rejected` columns (the prompt may be rendered from other
  columns by `prompt_template`, as the completion type does); EOS is appended to both sides.
- conversational: `chosen` and `rejected` are message lists (`role`/`content`), with the prompt
  turns either in a `prompt` message list or shared at the head of both (TRL's implicit
  prompt, which is split off here). They are rendered with the chat template
  (`data.chat_template`, else the tokenizer's): the prompt with the generation prompt, each side
  as what the full conversation adds after it, end-of-turn marker included.

Each side is tokenized like a completion row (prompt and completion apart, so the mask boundary
is exact; loss on the completion only). A pair whose sides are equal, or whose side is empty,
has nothing to prefer: it is dropped and counted. The tokenized split holds the chosen side as
`input_ids`/`labels` (so loss, perplexity and generation read it as the reference answer) and
the rejected side as `rejected_input_ids`/`rejected_labels`. TRL's optional `margin` column
(a number per pair: how much better chosen is, for `training.type: reward`) is carried through
as `margin` when the rows have one (a missing value is 0).
"""

from __future__ import annotations

import numbers
from typing import Any

from finetune.datatypes.base import DataContext, DatasetType, Formatted
from finetune.datatypes.chat import chat_template, normalise, render, row_tools
from finetune.datatypes.conversation import dataset_tools, tool_fault
from finetune.datatypes.encoding import IGNORE_INDEX, empty_encoding, token_ids
from finetune.datatypes.rows import builder, placeholders
from finetune.errors import PipelineError

#: why a pair has nothing to learn (dropped and counted)
EMPTY = "an empty side, or chosen equal to rejected"

#: the tokenized columns of the rejected side, next to input_ids/labels (the chosen side)
REJECTED_COLUMNS = ("rejected_input_ids", "rejected_labels")


class PreferenceType(DatasetType):
    name = "preference"
    aliases = ("dpo", "pairwise")
    keys = ("prompt_template", "chat_template", "system_prompt", "tools", "tools_field")
    targets = "pairs"
    trainer_hint = ("pairs train with training.type: dpo (sft would learn only the chosen "
                    "side); set training.type: dpo")
    untrainable = ("max_seq_length cuts off a side's completion, or where the two sides "
                   "differ")

    def prepare(self, ctx: DataContext) -> None:
        if self.data.chat_template:
            chat_template(self.data, ctx.tokenizer, ctx.root)  # a template file: read here
        dataset_tools(self.data, ctx.root)

    def required_columns(self) -> list[str]:
        d = self.data
        prompt = placeholders(d.prompt_template, "prompt_template") if d.prompt_template else []
        return [*prompt, "chosen", "rejected"]

    def nullable_columns(self) -> tuple[str, ...]:
        return ("chosen", "rejected")

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """Rows of prompt, completion (the chosen side), rejected and eos (whether the
        encoder appends EOS: strings yes, a chat template ends its turns itself)."""
        import pandas as pd

        has_prompt = "prompt" in frame.columns or self.data.prompt_template
        prompt_of = builder(self.data, "prompt") if self.data.prompt_template else None
        out: dict[str, list] = {"prompt": [], "completion": [], "rejected": [], "eos": []}
        if "margin" in frame.columns:
            out["margin"] = []
        reasons: dict[int, str] = {}
        records = frame.to_dict("records")
        tools = None
        for i, row in enumerate(records, start=first_row):
            where = f"split '{split}' row {i}"
            chosen, rejected = row.get("chosen"), row.get("rejected")
            if _missing(chosen) or _missing(rejected):
                reasons[i] = EMPTY
                continue
            if isinstance(chosen, str) != isinstance(rejected, str):
                raise PipelineError(f"{where}: chosen and rejected must both be strings or both "
                                    "message lists")
            if isinstance(chosen, str):
                prompt = prompt_of(row) if prompt_of else (row.get("prompt") if has_prompt
                                                            else "")
                if not isinstance(prompt, str):
                    raise PipelineError(f"{where} column 'prompt': a string pair needs a string "
                                        f"prompt, got {type(prompt).__name__}")
                pair, eos = (prompt, chosen, rejected), True
            else:
                if tools is None:  # each row's tools: read once, for conversational pairs
                    tools = row_tools(frame, self.data, split, ctx.root)
                pair, eos = self._render(row, where, ctx, tools[i - first_row]), False
            if isinstance(pair, str):  # a side's tool use breaks a row contract
                reasons[i] = pair
                continue
            if pair is None or not pair[1].strip() or not pair[2].strip() or pair[1] == pair[2]:
                reasons[i] = EMPTY
                continue
            for key, value in zip(("prompt", "completion", "rejected"), pair):
                out[key].append(value)
            out["eos"].append(eos)
            if "margin" in out:
                out["margin"].append(_margin(row.get("margin"), where))
        return Formatted.with_reasons(pd.DataFrame(out), reasons)

    def _render(self, row: dict, where: str, ctx: DataContext, tools: list[dict]
                ) -> tuple[str, str, str] | str | None:
        """A conversational pair as (prompt text, chosen text, rejected text): the chat
        template's rendering of the prompt turns with the generation prompt (and the row's
        tools), and what each full conversation adds after it. None: a side has nothing to
        learn; a string: a side breaks a tool-use row contract (why)."""
        chosen = _messages(row["chosen"], f"{where} column 'chosen'")
        rejected = _messages(row["rejected"], f"{where} column 'rejected'")
        if row.get("prompt") is not None and not isinstance(row.get("prompt"), str):
            prompt = _messages(row["prompt"], f"{where} column 'prompt'")
        else:  # TRL's implicit prompt: the turns both sides share
            shared = 0
            while (shared < min(len(chosen), len(rejected)) - 1
                   and chosen[shared] == rejected[shared]):
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        rendered = render_sides(self.data, ctx, prompt,
                                (("chosen", chosen), ("rejected", rejected)), where, tools)
        if rendered is None or isinstance(rendered, str):
            return rendered
        head, (chosen_text, rejected_text) = rendered
        return head, chosen_text, rejected_text

    def serving_chat_template(self, tok, root) -> str | None:
        return chat_template(self.data, tok, root) if self.data.chat_template else None

    def formatted_schema(self):
        import pandera.pandas as pa

        from finetune.datatypes.contract import non_empty_text, pair_schema

        return pair_schema(empty_prompt=True,
                           rejected=pa.Column(str, [non_empty_text()], nullable=False),
                           eos=pa.Column(bool, nullable=False))

    def encoder(self, ctx: DataContext):
        return encode_preference, {"bos": ctx.bos, "max_len": self.data.max_seq_length}

    def examples(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> list[dict]:
        raise PipelineError("data.streaming: preference pairs are read from the tokenized "
                            "split; set data.streaming to false")

    def reported_metrics(self) -> tuple[str, ...]:
        from finetune.datatypes.metrics import PREFERENCE_METRICS

        return (*super().reported_metrics(), *PREFERENCE_METRICS)


def _missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float):  # pandas' NaN for a missing string
        return value != value
    return False


def _margin(value: Any, where: str) -> float:
    """A pair's `margin` as a float (missing: 0); anything else is one line naming the row."""
    if _missing(value):
        return 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PipelineError(f"{where} column 'margin': a number, got {value!r}")
    return float(value)


def _messages(value: Any, where: str) -> list[dict]:
    """A message list as plain dicts (parquet hands numpy arrays of mappings)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list) or not all(hasattr(m, "keys") for m in value):
        raise PipelineError(f"{where}: not a list of messages")
    return [dict(m) for m in value]


def render_sides(data, ctx: DataContext, prompt: list[dict],
                 sides: tuple[tuple[str, list[dict]], ...], where: str, tools: list[dict]
                 ) -> tuple[str, list[str]] | str | None:
    """(prompt text, [each side's text]) of conversational completions `sides` ((column name,
    messages) each) after the `prompt` turns: the chat template's rendering of the prompt with
    the generation prompt (and the row's tools), and what each full conversation adds after
    it (TRL's split; the unpaired type's single completion uses it too). None: a side has
    nothing to learn; a string: a side breaks a tool-use row contract (why)."""
    tok = ctx.tokenizer
    template = chat_template(data, tok, ctx.root)
    convs = []
    for name, side in sides:
        conv = normalise(prompt + side, data.system_prompt, f"{where} ({name})")
        if conv is None:
            return None
        fault = tool_fault(conv, tools)
        if fault is not None:
            return f"{fault} in {name}"
        convs.append(conv)
    first = convs[0]
    head = render(tok, template, first[:len(first) - len(sides[0][1])], generation_prompt=True,
                  tools=tools)
    texts = []
    for conv, (name, _) in zip(convs, sides):
        full = render(tok, template, conv, tools=tools)
        if not full.startswith(head):
            raise PipelineError(
                f"data.chat_template cannot split {where} ({name}): the rendering of the "
                "conversation does not start with the rendering of its prompt turns")
        texts.append(full[len(head):])
    strip_bos = tok.bos_token if ctx.bos is not None else None
    if strip_bos and head.startswith(strip_bos):  # the encoder adds BOS as a token
        head = head[len(strip_bos):]
    return head, texts


def encode_preference(batch: dict[str, list], tok, bos: int | None, max_len: int
                      ) -> dict[str, list]:
    """Both sides of each pair as completion rows (prompt and side tokenized apart, the side
    trained, EOS appended where the row says), each truncated to `max_len`. `n_trainable` is
    the smaller side's, so a pair that lost one side to truncation is dropped as untrainable,
    and 0 when truncation left both sides equal (the difference was cut off)."""
    n = len(batch["prompt"])
    ids = token_ids(tok, [*batch["prompt"], *batch["completion"], *batch["rejected"]])
    out = {**empty_encoding(), **{c: [] for c in REJECTED_COLUMNS}}
    if "margin" in batch:  # TRL's optional per-pair margin (a reward model's loss reads it)
        out["margin"] = [float(m) for m in batch["margin"]]
    eos = tok.eos_token_id
    for i in range(n):
        head = ([bos] if bos is not None else []) + ids[i]
        tail = [eos] if batch["eos"][i] else []
        sides = []
        for body in (ids[n + i], ids[2 * n + i]):
            seq = head + body + tail
            labels = [IGNORE_INDEX] * len(head) + body + tail
            sides.append((seq[:max_len], labels[:max_len], len(seq) > max_len))
        add_pair(out, *sides)
    return out


def add_pair(out: dict[str, list], chosen: tuple, rejected: tuple) -> None:
    """One encoded pair, each side (ids, labels, cut by max_seq_length), with its counts:
    `n_trainable` the smaller side's trained tokens, 0 when truncation left the sides equal
    (it cut off where they differ: nothing to prefer)."""
    (c_ids, c_labels, c_cut), (r_ids, r_labels, r_cut) = chosen, rejected
    out["input_ids"].append(c_ids)
    out["labels"].append(c_labels)
    out["rejected_input_ids"].append(r_ids)
    out["rejected_labels"].append(r_labels)
    out["truncated"].append(c_cut or r_cut)
    same = c_ids == r_ids
    out["n_trainable"].append(0 if same else min(sum(x != IGNORE_INDEX for x in c_labels),
                                                 sum(x != IGNORE_INDEX for x in r_labels)))
