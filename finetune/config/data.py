"""Config of the data stages (download, format, tokenize): where the examples come from, what a
row is (`dataset_type`) and how it becomes tokens.

Kept apart from the training sections: these keys drive the data stages (dvc.yaml tracks them
per stage), and they grow with every format users bring.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator

from finetune.config.section import Section


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
    train_split: str = Field("train", description="Name of the training split.")
    test_split: str | None = Field("test", description="Name of the evaluation split.")
    split_ratio: float = Field(
        0.8, gt=0, lt=1,
        description="Fraction of the train split kept for TRAINING when the source has no test "
        "split (seed 004's meaning; the rest, seeded by data.seed, becomes the test split). Until "
        "issue 19 this key was the TEST fraction: an old params file's 0.1 now trains on 10%.",
    )
    prompt_template: str | None = Field(
        "Question: {question}\nAnswer:", description="Prompt with {column} placeholders."
    )
    prompt_func: str | None = Field(
        None, description="'module:function' or 'path/to/file:function' (a project file, as "
        "the seeds write it) row -> prompt string.")
    completion_template: str | None = Field(
        " {answer}", description="Completion with {column} placeholders."
    )
    completion_func: str | None = Field(
        None, description="'module:function' or 'path/to/file:function' row -> completion.")
    text_field: str | None = Field(
        None,
        description="Plain-text training column when no templates are set "
        "(auto-detected: 'text' or the only string column).",
    )
    dataset_type: Literal["completion", "text", "chat", "classification"] = Field(
        "completion",
        description="completion: prompt/completion from the templates (loss on the completion); "
        "text: every token of one text column (text_field); chat: conversations in a messages "
        "column (role/content, or ShareGPT from/value) rendered with a chat template, loss on "
        "the assistant turns; classification: a text (text_field, or prompt_template/"
        "prompt_func) and a label column, trained with AutoModelForSequenceClassification.",
    )
    label_column: str = Field(
        "label", validation_alias=AliasChoices("label_column", "target_column"),
        description="classification: the label column (strings or ints). Alias: target_column "
        "(seed 004).",
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
    max_seq_length: int = Field(512, gt=0, description="Tokens per example after truncation.")
    max_train_samples: int | None = Field(None, gt=0, description="Keep the first N train rows.")
    max_eval_samples: int | None = Field(None, gt=0, description="Keep the first N test rows.")
    max_dropped_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Fail tokenize when more than this fraction of rows has no trainable token.",
    )
    num_proc: int = Field(1, gt=0, description="Worker processes for tokenization.")
    seed: int = Field(42, description="Seed for the train/test split and the stream shuffle.")
    streaming: bool = Field(
        False,
        description="Stream the train split (datasets IterableDataset, hub or local files) and "
        "format/tokenize it on the fly in the train stage: for corpora that do not fit on disk. "
        "Needs training.max_steps > 0.",
    )
    shuffle_buffer: int = Field(
        10_000, ge=1, description="Streaming: examples in the shuffle buffer (1: stream order); "
        "reshuffled per epoch with seed + epoch.",
    )

    @model_validator(mode="after")
    def _sources_and_templates(self) -> "DataConfig":
        sources = [k for k in ("dataset_name", "json_file_path", "data_files") if getattr(self, k)]
        if len(sources) != 1:
            raise ValueError(
                "set exactly one of dataset_name, json_file_path, data_files "
                f"(got {', '.join(sources) or 'none'})"
            )
        self._check_type_keys()
        if self.dataset_type != "completion":
            return self
        for part in ("prompt", "completion"):
            if getattr(self, f"{part}_template") is not None and getattr(self, f"{part}_func"):
                raise ValueError(
                    f"{part}_template and {part}_func are exclusive; set one of them to null"
                )
        has_prompt = self.prompt_template is not None or self.prompt_func
        has_completion = self.completion_template is not None or self.completion_func
        if has_prompt and not has_completion:
            raise ValueError("a prompt is set but no completion_template/completion_func")
        if has_completion and not has_prompt and self.text_field is None:
            raise ValueError("a completion is set but no prompt_template/prompt_func")
        return self

    def _check_type_keys(self) -> None:
        """Keys of another dataset type, set in the params file, are a conflict, not ignored
        (the template defaults belong to `completion` and are not used by the others)."""
        templates = ("prompt_template", "prompt_func", "completion_template", "completion_func")
        chat = ("messages_field", "chat_template", "system_prompt", "assistant_only_loss",
                "last_turn_only")
        classes = ("label_column", "labels")
        foreign = {"completion": chat + classes, "text": templates + chat + classes,
                   "chat": templates + ("text_field",) + classes,
                   "classification": templates[2:] + chat}[self.dataset_type]
        fields = type(self).model_fields
        clash = [k for k in foreign if k in self.model_fields_set
                 and getattr(self, k) not in (None, fields[k].default)]
        if clash:
            raise ValueError(f"{clash[0]} does not apply to dataset_type {self.dataset_type}; "
                             "remove it or change data.dataset_type")
        if self.last_turn_only and not self.assistant_only_loss:
            raise ValueError("last_turn_only needs assistant_only_loss: true")
        if self.streaming and self.dataset_type in ("chat", "classification"):
            raise ValueError(f"streaming reads completion and text datasets; a "
                             f"{self.dataset_type} dataset is formatted and tokenized by its "
                             "stages: set streaming: false")
        if self.dataset_type == "classification":
            if self.input_template_key and self.text_field:
                raise ValueError(f"text_field and {self.input_template_key} both name the "
                                 "classification input; set one of them")
            if self.labels and len(set(self.labels)) != len(self.labels):
                raise ValueError(f"labels {self.labels} repeats a class name")

    @property
    def text_mode(self) -> bool:
        """Train on every token of one text column: dataset_type text, or no templates at
        all."""
        if self.dataset_type != "completion":
            return self.dataset_type == "text"
        return not any(
            (self.prompt_template, self.prompt_func, self.completion_template, self.completion_func)
        )

    @property
    def input_template_key(self) -> str | None:
        """classification: the prompt key that renders the input text, when one is set to
        another value than its default (the defaults belong to `completion`)."""
        fields = type(self).model_fields
        for key in ("prompt_template", "prompt_func"):
            if getattr(self, key) not in (None, fields[key].default):
                return key
        return None
