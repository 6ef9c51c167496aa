"""Config of the data stages (download, format, tokenize): where the examples come from, what a
row is (`dataset_type`) and how it becomes tokens.

Kept apart from the training sections: these keys drive the data stages (dvc.yaml tracks them
per stage), and they grow with every format users bring.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import AliasChoices, create_model, field_validator, model_validator

from finetune.config import compat
from finetune.config.section import Field, Section, did_you_mean


#: data.collate_fn's names for the pipeline's own collators (QEfficient's names), each with
#: what it does; anything else is a 'module:function' of the project
NAMED_COLLATORS = {"dynamic_padding": "pad each batch to its longest row (the default)"}


class DataConfig(Section):
    """Where the examples come from and how they become prompt/completion pairs."""

    dataset_name: str | None = Field(None, description="Hub dataset id (datasets.load_dataset).")
    subset: str | None = Field(None, description="Hub dataset configuration name.")
    json_file_path: str | None = Field(
        None, description="Local json/jsonl/csv/parquet file used as the train split."
    )
    data_files: dict[str, str] | None = Field(
        None, description="Local files per split, e.g. {train: a.jsonl, test: b.jsonl}."
    )
    train_split: str = Field(
        "train", description="The training split, or a slice of it as datasets writes one: "
        "train[:1000], train[10%:], train[:50%]+validation[:100].")
    test_split: str | None = Field(
        "test", description="The evaluation split (sliced the same way); null: none. Missing "
        "from a source with only a train split: carved from it by split_ratio.")
    split_ratio: float = Field(
        0.8, gt=0, lt=1,
        description="Fraction of the train split kept for TRAINING when the source has no test "
        "split (QEfficient's meaning; the rest, seeded by data.seed, becomes the test split). Earlier "
        "versions of this pipeline read it as the TEST fraction: an old params file's 0.1 now trains on 10%.",
    )
    prompt_template: str | None = Field(
        "Question: {question}\nAnswer:", description="Prompt with {column} placeholders."
    )
    prompt_func: str | None = Field(
        None, description="'module:function' or 'path/to/file:function' (a project file, as "
        "QEfficient writes it) row -> prompt string.")
    completion_template: str | None = Field(
        " {answer}", description="Completion with {column} placeholders."
    )
    completion_func: str | None = Field(
        None, description="'module:function' or 'path/to/file:function' row -> completion.")
    input_columns: list[str] | None = Field(
        None, min_length=1,
        description="The raw columns prompt_func/completion_func receive (datasets' map "
        "input_columns); the raw contract requires them present and non-null. None: every "
        "column, unchecked.",
    )
    text_field: str | None = Field(
        None,
        description="The text column of a text or classification row, and of a completion "
        "row when no template is set (auto-detected when omitted: 'text', 'content' or the "
        "only string column). Setting it with no template or function set trains on it.",
    )
    dataset_type: str = Field(
        "completion",
        description="What a row is. completion (alias seq_completion): prompt/completion from "
        "the templates or functions (loss on the completion; no template: the text column); "
        "text: every token of one text column (text_field); chat (aliases conversational, "
        "sharegpt): conversations in a messages column (role/content, or ShareGPT from/value) "
        "rendered with a chat template, loss on the assistant turns; classification: a text "
        "(text_field, or prompt_template/prompt_func) and a label column, trained with "
        "AutoModelForSequenceClassification; or a project's own type as 'module:Class' (a "
        "finetune.datatypes.DatasetType subclass).",
    )
    label_column: str | None = Field(
        "label", validation_alias=AliasChoices("label_column", "target_column"),
        description="classification: the label column (strings or ints). Alias: target_column "
        "(QEfficient; its default null means no classification, as for any other type).",
    )
    labels: list[str] | None = Field(
        None, min_length=2,
        description="classification: every class name, in id order (None: the sorted distinct "
        "labels of the train split). Stored with the model as id2label/label2id.",
    )
    messages_field: str | None = Field(
        None, description="chat: the conversation column (auto: messages, then conversations)."
    )
    chat_template: str | None = Field(
        None,
        description="chat: a Jinja chat template, or a file holding one (relative to the "
        "project); None: the tokenizer's own.",
    )
    system_prompt: str | None = Field(
        None, description="chat: a system message put first where a conversation has none."
    )
    assistant_only_loss: bool = Field(
        True,
        description="chat: train the assistant turns only, each with its end-of-turn marker "
        "(false: every token of the conversation).",
    )
    last_turn_only: bool = Field(
        False, description="chat: train only the last assistant turn of each conversation."
    )
    roles_to_train: list[Literal["system", "user", "assistant"]] = Field(
        ["assistant"], min_length=1,
        description="chat: the roles whose turns are trained (Axolotl's name); tool results "
        "never are (they are what a tool returned, not what the model should say).")
    train_on_eos: bool = Field(
        True, description="chat: train each trained turn's end-of-turn marker (the template's "
        "<|im_end|>, <|eot_id|>, </s>): the model learns to stop. false: the marker is left out.")
    train_on_reasoning: bool = Field(
        True, description="chat: train an assistant turn's reasoning (reasoning_content, or a "
        "<think>...</think> block leading its content) as the template renders it. false: the "
        "reasoning is context only.")
    tools: list[dict[str, Any]] | str | None = Field(
        None, description="chat, preference, prompt: the tools (JSON schemas, OpenAI form "
        "{type: function, function: {name, description, parameters}} or bare {name, ...}) of "
        "every row, or a .json file holding the list (relative to the project); passed to the "
        "chat template as `tools`. A row's own tools column wins where it is not null.")
    tools_field: str | None = Field(
        None, description="chat, preference, prompt: the column holding each row's tools "
        "(auto: 'tools' when the split has one).")
    max_seq_length: int = Field(
        512, fingerprint=True, gt=0, description="Tokens per example after truncation.")
    max_train_samples: int | None = Field(None, gt=0, description="Keep the first N train rows.")
    max_eval_samples: int | None = Field(None, gt=0, description="Keep the first N test rows.")
    max_dropped_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Rows with nothing to learn are dropped and counted: in format, an empty "
        "or whitespace-only completion, a conversation with an empty assistant turn, a "
        "classification row without a label; in tokenize, a row left with no trainable token "
        "(the prompt fills max_seq_length). A split where more than this fraction is dropped "
        "fails the stage instead.",
    )
    num_proc: int | None = Field(
        None, gt=0, description="Worker processes for tokenization; null: the usable cores "
        "(os.sched_getaffinity). The tokenized bytes are the same for any number.")
    seed: int = Field(42, ge=0, le=2**32 - 1,
                      description="Seed for the train/test split and the stream shuffle.")
    collate_fn: str | None = Field(
        None, code_ref=tuple(NAMED_COLLATORS),
        validation_alias=AliasChoices("collate_fn", "data_collator"),
        description="'module:function' that turns a list of examples ({input_ids, labels} "
        "lists) into a batch ({input_ids, labels, attention_mask} tensors, labels -100 where "
        "not trained), as HF's data_collator (alias data_collator; QEfficient's collate_fn), "
        "or a collator's name: dynamic_padding (QEfficient's default: each batch padded to its "
        "longest row, training.pad_to_multiple_of applies), which None also means. It builds "
        "the training batches and the evaluation ones (in training and in the evaluate "
        "stage); a function is checked on two train rows before launch. Not with packing or "
        "padding_free; a function not with training.pad_to_multiple_of (it decides the width).",
    )
    streaming: bool = Field(
        False,
        description="Stream the train split (datasets IterableDataset, hub or local files) and "
        "format/tokenize it on the fly in the train stage: for corpora that do not fit on disk. "
        "Needs training.max_steps > 0 or training.epoch_train_steps.",
    )
    shuffle_buffer: int = Field(
        10_000, ge=1, description="Streaming: examples in the shuffle buffer (1: stream order); "
        "reshuffled per epoch with seed + epoch.",
    )

    @model_validator(mode="before")
    @classmethod
    def _template_defaults_step_aside(cls, raw):
        """The template defaults are the embedded GSM8K example's prompt and completion: they
        apply to a completion dataset whose params say nothing about how rows become text.
        A file that sets a template, a prompt or completion function or the text field, or
        another dataset type, gets none of them (instead of a clash with its own choice)."""
        if not isinstance(raw, dict) or raw.get("sources"):
            return raw
        shaping = [k for k in TEXT_KEYS if raw.get(k) is not None]
        completion = _canonical_or_same(raw.get("dataset_type", "completion")) == "completion"
        if shaping or not completion:
            raw = {**{k: None for k in TEMPLATE_KEYS}, **raw}
        return raw

    @field_validator("collate_fn")
    @classmethod
    def _named_or_reference(cls, value: str | None) -> str | None:
        if value is None or value in NAMED_COLLATORS or ":" in value:
            return value
        raise ValueError(f"'{value}' is neither a 'module:function' of the project nor a "
                         f"collator's name: {', '.join(NAMED_COLLATORS)}"
                         f"{did_you_mean(value, NAMED_COLLATORS)}")

    @property
    def user_collate_fn(self) -> str | None:
        """collate_fn when it names the project's function ('module:function'); None for
        the pipeline's own collators (a name, or none)."""
        return None if self.collate_fn in (None, *NAMED_COLLATORS) else self.collate_fn

    @field_validator("dataset_type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        from finetune.datatypes.registry import canonical

        return canonical(name)

    @model_validator(mode="after")
    def _compat(self) -> "DataConfig":
        compat.check(self, "data")  # the rules among data keys (finetune/config/compat.py)
        if self.sources is not None:
            self._check_sources()
            compat.check(self, "data.sources")
        else:
            self.datatype.check()  # the rules among the type's own keys
        return self

    @property
    def datatype(self):
        """This (one-source) config's dataset type: the stages ask it, never the name."""
        from finetune.datatypes.registry import type_class

        return type_class(self.dataset_type)(self)

    @property
    def targets(self) -> str:
        """What the rows give a method to train on (finetune.datatypes.base.TARGETS); a
        mixture's sources give the same (the trainer type accepts each: compat)."""
        return self.parts()[0][1].datatype.targets

    @property
    def task(self):
        """The model the data trains (finetune.datatypes.ModelTask); a mixture's sources all
        train the same one (checked)."""
        return self.parts()[0][1].datatype.task

    def _check_sources(self) -> None:
        """With `sources`, each source names its own dataset and is checked as the one-source
        config it stands for (data section keys it does not set included), its errors naming
        it."""
        for i, source in enumerate(self.sources):
            try:
                self.for_source(source)
            except ValueError as exc:
                first = getattr(exc, "errors", lambda: [{"msg": str(exc), "loc": ()}])()[0]
                where = ".".join(str(p) for p in first["loc"])
                msg = first["msg"].removeprefix("Value error, ")
                raise ValueError(f"sources[{i}] ({source.name}): "
                                 f"{where + ': ' if where else ''}{msg}") from None

    def for_source(self, source: "SourceConfig") -> "DataConfig":
        """The one-source config a source stands for: the keys it sets, the data section's
        for the rest (its templates, split_ratio, max_seq_length, seed, ...)."""
        own = {k: getattr(source, k) for k in source.model_fields_set
               if k not in ("name", "weight", "eval_only")}
        shared = {k: getattr(self, k) for k in self.model_fields_set
                  if k not in SOURCE_LOCATION and k not in MIXTURE_KEYS and k not in own}
        # how rows become text is the source's own when it says anything about it (or is of
        # another type): the data section's templates step aside rather than clash
        if any(own.get(k) is not None for k in TEXT_KEYS) or (
                "dataset_type" in own and _canonical_or_same(own["dataset_type"])
                != _canonical_or_same(self.dataset_type)):
            shared = {k: v for k, v in shared.items() if k not in TEXT_KEYS}
        return DataConfig(**{**shared, **own})

    def eval_only(self, name: str | None) -> bool:
        """Whether the source called `name` is only evaluated on."""
        return any(s.name == name and s.eval_only for s in self.sources or ())

    def parts(self) -> list[tuple[str | None, "DataConfig"]]:
        """(source name, its config) for each source; one source: [(None, self)], whose files
        sit directly in the stage folders as they always did."""
        if self.sources is None:
            return [(None, self)]
        return [(s.name, self.for_source(s)) for s in self.sources]

    sources: list["SourceConfig"] | None = Field(
        None, min_length=2,
        description="Several datasets mixed into one: each a mapping with a name, a weight, its "
        "dataset (dataset_name/subset, json_file_path or data_files) and any data key that "
        "belongs to one source (splits, dataset_type, templates, chat keys, max_train_samples, "
        "...); a key a source does not set is the data section's. Test splits are "
        "concatenated.",
    )
    mixing: Literal["concatenate", "interleave"] = Field(
        "concatenate",
        description="sources: concatenate (every train row once) or interleave (datasets."
        "interleave_datasets: rows drawn with probabilities from the weights, seeded by "
        "data.seed).",
    )
    stopping_strategy: Literal["first_exhausted", "all_exhausted"] = Field(
        "first_exhausted",
        description="mixing interleave: stop when the first source runs out, or when every "
        "source has been seen whole (the others repeat: oversampling).",
    )


#: keys that belong to one source (a `sources` entry may set them, else it inherits the data
#: section's; the rest are shared by all)
PER_SOURCE = ("dataset_name", "subset", "json_file_path", "data_files", "train_split",
              "test_split", "split_ratio", "prompt_template", "prompt_func",
              "completion_template", "completion_func", "input_columns", "text_field",
              "dataset_type", "messages_field", "chat_template", "system_prompt",
              "assistant_only_loss", "last_turn_only", "roles_to_train", "train_on_eos",
              "train_on_reasoning", "tools", "tools_field", "label_column", "max_train_samples",
              "max_eval_samples")
#: the keys that say where a source's rows come from (never at the top level with sources)
SOURCE_LOCATION = ("dataset_name", "json_file_path", "data_files")
MIXTURE_KEYS = ("sources", "mixing", "stopping_strategy")
TEMPLATE_KEYS = ("prompt_template", "prompt_func", "completion_template", "completion_func")
#: the keys that say how a row becomes text
TEXT_KEYS = TEMPLATE_KEYS + ("text_field",)


def _canonical_or_same(name):
    """An alias's type name (validation proper reports an unknown one)."""
    from finetune.datatypes.registry import canonical

    try:
        return canonical(name) if isinstance(name, str) else name
    except ValueError:
        return name


def _source_fields() -> dict[str, Any]:
    """A source's keys are the data section's own (same types and meanings), unset = default."""
    fields: dict[str, Any] = {
        "name": (str, Field(description="The source's name: its folder under data/raw, "
                            "data/formatted and its rows in data/metrics/tokenize.json.")),
        "weight": (float, Field(1.0, gt=0, description="Relative sampling probability "
                                "(mixing: interleave).")),
        "eval_only": (bool, Field(False, description="Evaluate on this source, never train "
                                  "on it: its train split's rows (a file, a hub split or a "
                                  "slice) join the test split.")),
    }
    for key in PER_SOURCE:
        f = DataConfig.model_fields[key]
        fields[key] = (f.annotation, Field(f.default, description=f.description,
                                           validation_alias=f.validation_alias))
    return fields


def _plain_name(cls, name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*", name):
        raise ValueError(f"'{name}' must be a plain folder name (letters, digits, _ . -)")
    return name


SourceConfig = create_model(
    "SourceConfig", __base__=Section, __doc__="One dataset of a mixture (`data.sources`).",
    __validators__={"_plain_name": field_validator("name")(_plain_name)}, **_source_fields())
DataConfig.model_rebuild()
