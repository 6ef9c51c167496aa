"""Stage 2, format: raw rows -> `data/formatted/{train,test}.parquet` (prompt, completion).

Templates use `{column}` placeholders; `module:function` callables take the row as a dict. A
missing column or a failing function is reported with the split and row number.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from finetune.config.data import DataConfig
from finetune.errors import PipelineError
from finetune.files import atomic_dir
from finetune.workspace import Workspace
from tasks.contracts import validate_formatted
from tasks.stream_manifest import carry_manifest
from tasks.templates import builder


def format_prompts(ws: Workspace) -> dict[str, Path]:
    """Run the stage; each source of a mixture is formatted with its own keys into its own
    folder (`<source>/<split>` in the result)."""
    top = ws.config.data
    out: dict[str, Path] = {}
    with atomic_dir(ws.layout.formatted) as staging:
        for name, data in top.parts():
            folder = staging / name if name else staging
            folder.mkdir(exist_ok=True)
            raw = ws.layout.raw / name if name else ws.layout.raw
            for key, file in _format_source(ws, data, raw, folder, name).items():
                out[f"{name}/{key}" if name else key] = (
                    ws.layout.formatted / file.relative_to(staging))
        carry_manifest(ws.layout.raw, staging, **{
            k: getattr(top, k) for k in ("prompt_template", "prompt_func", "completion_template",
                                         "completion_func", "text_field", "dataset_type",
                                         "messages_field", "chat_template", "system_prompt")})
    if not out and not top.streaming:  # streaming without a test split: nothing to format
        raise PipelineError(f"{ws.layout.raw}: no raw splits; run the download stage first")
    return out


def _format_source(ws: Workspace, data: DataConfig, raw: Path, folder: Path,
                   name: str | None) -> dict[str, Path]:
    """One source's raw splits (in `raw`) -> formatted splits (in `folder`)."""
    prompt_fn = builder(data, "prompt")
    completion_fn = builder(data, "completion")
    chat = _chat_renderer(ws, data) if data.dataset_type == "chat" else None
    classify = (_classifier(data, raw, prompt_fn) if data.dataset_type == "classification"
                else None)
    out: dict[str, Path] = {}
    if classify is not None:
        out["labels"] = classify.write_labels(folder)
    for raw_file in sorted(raw.glob("*.parquet")):
        role = raw_file.stem
        split = f"{name}/{role}" if name else role  # how errors name it
        frame = pd.read_parquet(raw_file)
        if chat is not None:
            result = chat(frame, split)
        elif classify is not None:
            result = classify(frame, split)
        elif data.text_mode:
            column = detect_text_field(frame, data.text_field, split)
            result = pd.DataFrame({"prompt": [""] * len(frame),
                                   "completion": frame[column].astype(str).tolist()})
        else:
            prompts, completions = render(frame, prompt_fn, completion_fn, split)
            result = pd.DataFrame({"prompt": prompts, "completion": completions})
        validate_formatted(result, f"format split '{split}'", allow_empty_prompt=data.text_mode)
        result.to_parquet(folder / f"{role}.parquet", index=False)
        out[role] = folder / f"{role}.parquet"
    return out


def _chat_renderer(ws: Workspace, data: DataConfig):
    """(frame, split) -> formatted chat rows, with the model's tokenizer and chat template."""
    from engine.model import load_tokenizer
    from tasks.chat import chat_template, format_chat

    tok = load_tokenizer(ws.config.model, ws.root)
    template = chat_template(data, tok, ws.root)
    return lambda frame, split: format_chat(frame, data, tok, template, split)


class _classifier:
    """(frame, split) -> text/label rows, with the label map read from the raw train split."""

    def __init__(self, data: DataConfig, raw: Path, prompt_fn):
        from tasks.classification import class_names

        self.data = data
        train = raw / "train.parquet"
        if not train.exists():
            raise PipelineError(f"{train} missing; run the download stage first")
        self.names = class_names(pd.read_parquet(train), self.data)
        self.prompt_fn = prompt_fn if self.data.input_template_key else None

    def write_labels(self, folder: Path) -> Path:
        from engine.model import write_labels

        return write_labels(folder, self.names)

    def __call__(self, frame: pd.DataFrame, split: str) -> pd.DataFrame:
        from tasks.classification import format_classification

        if self.prompt_fn is not None:
            texts, _ = render(frame, self.prompt_fn, lambda row: "", split)
        else:
            column = detect_text_field(frame, self.data.text_field, split,
                                       exclude=self.data.label_column)
            texts = frame[column].astype(str).tolist()
        return format_classification(frame, self.data, self.names, texts, split)


def render(frame: pd.DataFrame, prompt_fn, completion_fn, role: str,
           first_row: int = 0) -> tuple[list, list]:
    """Prompt and completion strings for each row (the streamed train split calls this per
    chunk; `first_row` keeps error messages' row numbers absolute)."""
    prompts, completions = [], []
    for i, row in enumerate(frame.to_dict("records"), start=first_row):
        for part, fn, sink in (("prompt", prompt_fn, prompts), ("completion", completion_fn, completions)):
            try:
                value = fn(row)
            except KeyError as exc:
                raise PipelineError(
                    f"data.{part}_template names column {exc} which split '{role}' lacks "
                    f"(row {i}; columns: {', '.join(frame.columns)})"
                ) from None
            except Exception as exc:
                raise PipelineError(
                    f"data.{part}_func failed on split '{role}' row {i}: {type(exc).__name__}: {exc}"
                ) from None
            if not isinstance(value, str):
                raise PipelineError(
                    f"data.{part}_func returned {type(value).__name__} on split '{role}' row {i}; "
                    "it must return a string"
                )
            sink.append(value)
    return prompts, completions


def detect_text_field(frame: pd.DataFrame, text_field: str | None, role: str,
                      exclude: str | None = None) -> str:
    """`text_field` if given, else a column named text/content, else the only string column."""
    if text_field:
        if text_field not in frame.columns:
            raise PipelineError(f"data.text_field '{text_field}' is not a column of split '{role}'")
        return text_field
    for name in ("text", "content"):
        if name in frame.columns:
            return name
    strings = [c for c in frame.columns
               if c != exclude and pd.api.types.is_string_dtype(frame[c])]
    if len(strings) == 1:
        return strings[0]
    raise PipelineError(
        f"no templates set and no text column found in split '{role}' "
        f"(string columns: {', '.join(strings) or 'none'}); set data.text_field or the templates"
    )
