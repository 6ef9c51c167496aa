"""Classification datasets (`data.dataset_type: classification`): a text and a label per row.

The format stage renders the input text (`text_field`, auto-detected, or the prompt template
or function when the params file sets one) and checks every label against the label map:
`data.labels` in id order, or the sorted distinct labels of the train split. The map is written
next to the formatted splits (`labels.json`) and travels with the data to the model
(id2label/label2id in its config). Formatted rows keep the pipeline's prompt/completion shape:
the prompt is the text, the completion the class name.

Tokenize stores each row as the text's tokens with the class id as the only label, on the
last token (where a sequence classifier reads the text), so the trainer's token-weighted loss,
its counts and its batches work unchanged: one target per row.
"""

from __future__ import annotations

import pandas as pd

from finetune.config.data import DataConfig
from finetune.errors import PipelineError
from tasks.encoding import token_ids

IGNORE_INDEX = -100


def class_names(train: pd.DataFrame, data: DataConfig) -> list[str]:
    """The label map, in id order: `data.labels`, else the train split's distinct labels
    (numeric order when every label is an integer, else alphabetical)."""
    if data.labels:
        return list(data.labels)
    column = _labels(train, data, "train")
    values = column.unique().tolist()
    numeric = all(isinstance(v, int) or (isinstance(v, str) and v.lstrip("-").isdigit())
                  for v in values)
    names = sorted((str(v) for v in values), key=(lambda v: int(v)) if numeric else None)
    if len(names) < 2:
        raise PipelineError(f"data.label_column '{data.label_column}': split 'train' has one "
                            f"class ({names[0]!r}); a classifier needs two or more")
    return names


def _labels(frame: pd.DataFrame, data: DataConfig, split: str) -> pd.Series:
    if data.label_column not in frame.columns:
        raise PipelineError(f"data.label_column '{data.label_column}' is not a column of split "
                            f"'{split}' (columns: {', '.join(map(str, frame.columns))})")
    column = frame[data.label_column]
    missing = column.isna()
    if missing.any():
        raise PipelineError(f"data.label_column '{data.label_column}': split '{split}' row "
                            f"{int(missing.idxmax())} has no label")
    return column.map(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)


def format_classification(frame: pd.DataFrame, data: DataConfig, names: list[str], texts,
                          split: str) -> pd.DataFrame:
    """prompt = the input text, completion = the class name; a label outside the map is one
    line naming split, row and column."""
    labels = _labels(frame, data, split).map(str)
    unknown = ~labels.isin(names)
    if unknown.any():
        row = int(unknown.idxmax())
        raise PipelineError(
            f"data.label_column '{data.label_column}': split '{split}' row {row} has label "
            f"{labels[row]!r}, not in the label map ({', '.join(names)}); list every class in "
            "data.labels")
    return pd.DataFrame({"prompt": texts, "completion": labels.tolist()})


def encode_classification_batch(batch: dict[str, list], tok, bos: int | None, max_len: int,
                                names: list[str]) -> dict[str, list]:
    """Text tokens (BOS as the tokenizer adds it, no EOS: the classifier reads the last real
    token); the class id is the label of the last position, every other label ignored."""
    ids_of = token_ids(tok, list(batch["prompt"]))
    index = {name: i for i, name in enumerate(names)}
    out: dict[str, list] = {"input_ids": [], "labels": [], "n_trainable": [], "truncated": []}
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
