"""`unpaired_preference`: single completions labelled desirable or not (thumbs up / thumbs
down), for `training.type: kto`.

Rows come in TRL's layout: `prompt`, `completion` and a boolean `label` (true: desirable),
- strings: the prompt may be rendered from other columns by `prompt_template`, as the
  completion type does; EOS is appended to the completion.
- conversational: `prompt` and `completion` are message lists (`role`/`content`), rendered with
  the chat template as the preference type renders a pair's side
  (finetune.datatypes.preference.render_sides): the prompt with the generation prompt, the
  completion as what the full conversation adds after it, end-of-turn marker included.

Each row is tokenized like a completion row (prompt and completion apart; loss on the
completion only) and keeps its label as `desirable` (1 or 0). A row whose completion is empty
has nothing to learn: it is dropped and counted. A label that is not a bool is an error naming
the row: guessing what 0, "yes" or a missing label means would train the wrong way.
"""

from __future__ import annotations

from finetune.datatypes.base import DataContext, DatasetType, Formatted
from finetune.datatypes.chat import chat_template, row_tools
from finetune.datatypes.conversation import dataset_tools
from finetune.datatypes.encoding import IGNORE_INDEX, add_row, empty_encoding, token_ids
from finetune.datatypes.preference import _messages, _missing, render_sides
from finetune.datatypes.rows import builder, placeholders
from finetune.errors import PipelineError

#: why a row has nothing to learn (dropped and counted)
EMPTY = "an empty completion"

#: the tokenized column of each row's label: 1 desirable, 0 undesirable
LABEL_COLUMN = "desirable"


class UnpairedPreferenceType(DatasetType):
    name = "unpaired_preference"
    aliases = ("unpaired", "kto")
    keys = ("prompt_template", "chat_template", "system_prompt", "tools", "tools_field")
    targets = "unpaired"
    trainer_hint = ("labelled completions train with training.type: kto (sft would learn the "
                    "undesirable ones too); set training.type: kto")
    untrainable = "max_seq_length cuts off the completion"

    def prepare(self, ctx: DataContext) -> None:
        if self.data.chat_template:
            chat_template(self.data, ctx.tokenizer, ctx.root)  # a template file: read here
        dataset_tools(self.data, ctx.root)

    def required_columns(self) -> list[str]:
        d = self.data
        prompt = placeholders(d.prompt_template, "prompt_template") if d.prompt_template else []
        return [*prompt, "completion", "label"]

    def nullable_columns(self) -> tuple[str, ...]:
        return ("completion",)

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """Rows of prompt, completion, label (bool) and eos (whether the encoder appends EOS:
        strings yes, a chat template ends its turns itself)."""
        import pandas as pd

        has_prompt = "prompt" in frame.columns or self.data.prompt_template
        prompt_of = builder(self.data, "prompt") if self.data.prompt_template else None
        out: dict[str, list] = {"prompt": [], "completion": [], "label": [], "eos": []}
        reasons: dict[int, str] = {}
        tools = None
        for i, row in enumerate(frame.to_dict("records"), start=first_row):
            where = f"split '{split}' row {i}"
            label = row.get("label")
            if not isinstance(label, bool) and type(label).__name__ != "bool_":
                raise PipelineError(f"{where} column 'label': must be true or false (desirable "
                                    f"or not), got {label!r}")
            completion = row.get("completion")
            if _missing(completion):
                reasons[i] = EMPTY
                continue
            if isinstance(completion, str):
                prompt = prompt_of(row) if prompt_of else (row.get("prompt") if has_prompt
                                                            else "")
                if not isinstance(prompt, str):
                    raise PipelineError(f"{where} column 'prompt': a string completion needs a "
                                        f"string prompt, got {type(prompt).__name__}")
                texts, eos = (prompt, completion), True
            else:
                if tools is None:  # each row's tools: read once, for conversational rows
                    tools = row_tools(frame, self.data, split, ctx.root)
                texts, eos = self._render(row, where, ctx, tools[i - first_row]), False
            if isinstance(texts, str):  # the completion's tool use breaks a row contract
                reasons[i] = texts
                continue
            if texts is None or not texts[1].strip():
                reasons[i] = EMPTY
                continue
            out["prompt"].append(texts[0])
            out["completion"].append(texts[1])
            out["label"].append(bool(label))
            out["eos"].append(eos)
        return Formatted.with_reasons(pd.DataFrame(out), reasons)

    def _render(self, row: dict, where: str, ctx: DataContext, tools: list[dict]
                ) -> tuple[str, str] | str | None:
        """A conversational row as (prompt text, completion text)."""
        if not isinstance(row.get("prompt"), (list, tuple)) and not hasattr(row.get("prompt"),
                                                                          "tolist"):
            raise PipelineError(f"{where} column 'prompt': a conversational completion needs "
                                "the prompt as a message list")
        prompt = _messages(row["prompt"], f"{where} column 'prompt'")
        completion = _messages(row["completion"], f"{where} column 'completion'")
        rendered = render_sides(self.data, ctx, prompt, (("completion", completion),), where,
                                tools)
        if rendered is None or isinstance(rendered, str):
            return rendered
        head, (text,) = rendered
        return head, text

    def serving_chat_template(self, tok, root) -> str | None:
        return chat_template(self.data, tok, root) if self.data.chat_template else None

    def formatted_schema(self):
        import pandera.pandas as pa

        from finetune.datatypes.contract import pair_schema

        return pair_schema(empty_prompt=True, label=pa.Column(bool, nullable=False),
                           eos=pa.Column(bool, nullable=False))

    def encoder(self, ctx: DataContext):
        return encode_unpaired, {"bos": ctx.bos, "max_len": self.data.max_seq_length}

    def examples(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> list[dict]:
        raise PipelineError("data.streaming: labelled completions are read from the tokenized "
                            "split; set data.streaming to false")

    def eval_rows(self, formatted):
        """The desirable rows only: an undesirable completion is no reference answer."""
        kept = formatted[formatted["label"].astype(bool)]
        return kept[["prompt", "completion"]].rename(columns={"completion": "reference"})

    def reported_metrics(self) -> tuple[str, ...]:
        from finetune.datatypes.metrics import UNPAIRED_METRICS

        return (*super().reported_metrics(), *UNPAIRED_METRICS)


def encode_unpaired(batch: dict[str, list], tok, bos: int | None, max_len: int
                    ) -> dict[str, list]:
    """Completion rows (prompt and completion tokenized apart, the completion trained, EOS
    appended where the row says), truncated to `max_len`, with each row's label."""
    n = len(batch["prompt"])
    ids = token_ids(tok, [*batch["prompt"], *batch["completion"]])
    out = {**empty_encoding(), LABEL_COLUMN: [int(bool(x)) for x in batch["label"]]}
    eos = tok.eos_token_id
    for i in range(n):
        head = ([bos] if bos is not None else []) + ids[i]
        body = ids[n + i] + ([eos] if batch["eos"][i] else [])
        add_row(out, head + body, [IGNORE_INDEX] * len(head) + body, max_len)
    return out
