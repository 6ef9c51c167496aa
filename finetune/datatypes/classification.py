"""`classification` (QEfficient: `target_column`): a text and a label per row, trained as a
sequence classifier.

The format step renders the input text (`text_field`, auto-detected, or the prompt template or
function when the params file sets one) and checks every label against the label map:
`data.labels` in id order, or the sorted distinct labels of the training sources' train splits.
The map is written next to the formatted splits (`labels.json`) and travels with the data to
the model (id2label/label2id in its config). A row without a label (null or empty) has nothing
to learn: dropped and counted. Formatted rows keep the pipeline's prompt/completion shape: the
prompt is the text, the completion the class name.

Tokenization stores each row as the text's tokens with the class id as the only label, on the
last token (where a sequence classifier reads the text), so the trainer's token-weighted loss,
its counts and its batches work unchanged: one target per row.
"""

from __future__ import annotations

from finetune.datatypes.base import (SEQUENCE_CLASSIFICATION, DataContext, DatasetType,
                                     Formatted)
from finetune.datatypes.encoding import IGNORE_INDEX, empty_encoding, token_ids
from finetune.datatypes.rows import builder, detect_text_field, placeholders, render, text_column
from finetune.errors import PipelineError


class ClassificationType(DatasetType):
    name = "classification"
    aliases = ("seq_classification", "text_classification")
    keys = ("label_column", "labels", "text_field", "prompt_template", "prompt_func",
            "input_columns")
    task = SEQUENCE_CLASSIFICATION
    targets = "labels"

    @property
    def input_template_key(self) -> str | None:
        """The prompt key that renders the input text, when one is set."""
        for key in ("prompt_template", "prompt_func"):
            if getattr(self.data, key) is not None:
                return key
        return None

    def check(self) -> None:
        d = self.data
        if d.label_column is None:
            raise ValueError("label_column (target_column) is null; a classification dataset "
                             "names the column holding each row's label")
        if self.input_template_key and d.text_field:
            raise ValueError(f"text_field and {self.input_template_key} both name the "
                             "classification input; set one of them")
        if d.prompt_template is not None and d.prompt_func:
            raise ValueError("prompt_template and prompt_func are exclusive; set one of them "
                             "to null")
        if d.labels and len(set(d.labels)) != len(d.labels):
            raise ValueError(f"labels {d.labels} repeats a class name")
        if d.streaming and not d.labels:
            raise ValueError("a streamed classification dataset needs its classes in "
                             "data.labels (a stream cannot be read whole for them first)")

    def prepare(self, ctx: DataContext) -> None:
        builder(self.data, "prompt")  # prompt_func by reference: imported and checked here

    def required_columns(self) -> list[str]:
        d = self.data
        cols = [d.label_column] + ([d.text_field] if d.text_field else [])
        if d.prompt_template is not None:
            cols += placeholders(d.prompt_template, "prompt_template")
        if d.prompt_func and d.input_columns:
            cols += d.input_columns
        return list(dict.fromkeys(cols))

    def nullable_columns(self) -> tuple[str, ...]:
        return (self.data.label_column,)

    def label_values(self, train) -> list[str]:
        labels = _labels(train, self.data, "train")
        return labels[labels != ""].unique().tolist()

    def format(self, frame, split: str, ctx: DataContext, first_row: int = 0) -> Formatted:
        """prompt = the input text, completion = the class name; a label outside the map is one
        line naming split, row and column."""
        import pandas as pd

        d, names = self.data, ctx.labels
        if names is None:
            raise PipelineError("classification needs the label map (labels.json); run the "
                                "format stage again")
        if self.input_template_key:
            texts = render(frame, {"prompt": builder(d, "prompt")}, split, first_row)["prompt"]
        else:
            texts = text_column(frame, detect_text_field(frame, d.text_field, split,
                                                         exclude=d.label_column))
        labels = _labels(frame, d, split)
        unknown = (labels != "") & ~labels.isin(names)
        if unknown.any():
            row = int(unknown.idxmax())
            raise PipelineError(
                f"data.label_column '{d.label_column}': split '{split}' row "
                f"{first_row + row} has label {labels[row]!r}, not in the label map "
                f"({', '.join(names)}); list every class in data.labels")
        rows = pd.DataFrame({"prompt": texts, "completion": labels.tolist()})
        unlabeled = labels == ""
        return Formatted(rows[~unlabeled].reset_index(drop=True),
                         [first_row + int(i) for i in rows.index[unlabeled]], "no label")

    def encoder(self, ctx: DataContext):
        if ctx.labels is None:
            raise PipelineError("classification needs the label map (labels.json in the "
                                "formatted data); run the format stage again")
        return encode_classification_batch, {"bos": ctx.bos, "max_len": self.data.max_seq_length,
                                             "names": ctx.labels}

    def reported_metrics(self) -> tuple[str, ...]:
        from finetune.datatypes.metrics import CLASSIFICATION_METRICS

        return ("loss", *CLASSIFICATION_METRICS)

    def score(self, predictions: list, references: list, ev, ctx: DataContext
              ) -> dict[str, float]:
        from finetune.datatypes.metrics import classification_metrics

        return classification_metrics(predictions, references, len(ctx.labels))

    def row_scores(self, predictions: list, references: list, ev, ctx: DataContext
                   ) -> dict[str, list[float]]:
        """Accuracy's rows (1.0 where the class is right); macro-F1 is of the whole set."""
        return {"accuracy": [float(p == t) for p, t in zip(predictions, references)]}


def _labels(frame, data, split: str):
    """The label column as strings ('' where a row has none); integral floats (pandas reads an
    int column with a gap as floats) as ints."""
    if data.label_column not in frame.columns:
        raise PipelineError(f"data.label_column '{data.label_column}' is not a column of split "
                            f"'{split}' (columns: {', '.join(map(str, frame.columns))})")

    def as_text(v) -> str:
        if v is None or v != v:  # None, NaN
            return ""
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        return str(v).strip()

    return frame[data.label_column].map(as_text).reset_index(drop=True)


def encode_classification_batch(batch: dict[str, list], tok, bos: int | None, max_len: int,
                                names: list[str]) -> dict[str, list]:
    """Text tokens (BOS as the tokenizer adds it, no EOS: the classifier reads the last real
    token); the class id is the label of the last position, every other label ignored."""
    ids_of = token_ids(tok, list(batch["prompt"]))
    index = {name: i for i, name in enumerate(names)}
    out = empty_encoding()
    for text_ids, name in zip(ids_of, batch["completion"]):
        ids = ([bos] if bos is not None else []) + text_ids
        truncated = len(ids) > max_len
        ids = ids[:max_len]
        labels = [IGNORE_INDEX] * len(ids)
        trainable = len(ids) >= 2  # the trainer's counts skip position 0 (causal shift)
        if trainable:
            labels[-1] = index[name]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["n_trainable"].append(int(trainable))
        out["truncated"].append(truncated)
    return out
