"""`finetune show-rows`: the first rows of a tokenized split decoded, with the tokens that train
marked, so a template, `roles_to_train` or `train_on_eos` can be checked by eye before training.

What is shown is what the train stage reads (data/tokenized/<split>, written by the tokenize
stage): each row's `input_ids` decoded with the stages' tokenizer, the runs whose `labels` are
not -100 marked (text: between ⟦ and ⟧; html: <mark>, HTML-escaped, in a <pre>). A preference
row shows its rejected side after the chosen one; an encoder-decoder row (labels not aligned
with the input) its input, then its target marked; a classifier's row its class id; a
vision-language model's image tokens once per image, with their count (`<image>x16`).
"""

from __future__ import annotations

import html

from engine.datapath.data import load_tokenized, take_rows
from finetune.datatypes.encoding import IGNORE_INDEX
from finetune.errors import PipelineError
from finetune.workspace import Workspace
from tasks.format import data_context

FORMATS = ("text", "html")
#: (input column, labels column, heading) per side a tokenized row may have
SIDES = (("input_ids", "labels", ""), ("rejected_input_ids", "rejected_labels", "rejected: "))
OPEN = {"text": "⟦", "html": "<mark>"}
CLOSE = {"text": "⟧", "html": "</mark>"}


def show_rows(ws: Workspace, split: str = "train", rows: int = 2, fmt: str = "text") -> str:
    """The first `rows` rows of the tokenized `split`, decoded and marked in `fmt`."""
    if fmt not in FORMATS:
        raise PipelineError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    if rows < 1:
        raise PipelineError(f"--rows {rows}: expected at least 1")
    path = ws.layout.tokenized / split
    if not path.exists() and split == "train" and ws.config.data.streaming:
        raise PipelineError(f"{path} missing: data.streaming tokenizes the train split on the "
                            "fly, nothing is stored; show the test split (--split test)")
    if not path.exists():
        raise PipelineError(f"{path} missing: run the tokenize stage first "
                            f"(finetune stage tokenize -p {ws.params_path})")
    ds = load_tokenized(path, tuple(c for side in SIDES for c in side[:2]))
    ctx = data_context(ws)
    tok = ctx.tokenizer
    image = getattr(ctx.processor, "image_token", None)  # a vision-language model's
    blocks = []
    for i, row in enumerate(take_rows(ds, range(min(rows, len(ds))))):
        sides = [heading + images_counted(marked(tok, row[ids], row.get(labels), fmt), image,
                                          fmt)
                 for ids, labels, heading in SIDES if ids in row]
        blocks.append(f"--- {split} row {i} ---\n" + "\n".join(sides))
    body = "\n\n".join(blocks)
    if fmt == "html":
        return f"<pre>{body}</pre>"
    return body


def marked(tok, ids: list[int], labels, fmt: str) -> str:
    """One sequence decoded, its trained tokens marked."""
    if labels is None:
        return _escape(tok.decode(ids), fmt)
    if isinstance(labels, int):  # a classifier: one class id per row
        return f"{_escape(tok.decode(ids), fmt)} {OPEN[fmt]}label {labels}{CLOSE[fmt]}"
    if len(labels) != len(ids):  # encoder-decoder: the target is its own sequence
        target = [t for t in labels if t != IGNORE_INDEX]
        return (f"{_escape(tok.decode(ids), fmt)}\n"
                f"target: {OPEN[fmt]}{_escape(tok.decode(target), fmt)}{CLOSE[fmt]}")
    out, done = [], ""
    for start, end, trained in _runs([t != IGNORE_INDEX for t in labels]):
        # decode whole prefixes: a run decoded alone loses the space a word starts with
        text = tok.decode(ids[:end])
        piece = _escape(text[len(done):], fmt)
        out.append(f"{OPEN[fmt]}{piece}{CLOSE[fmt]}" if trained else piece)
        done = text
    return "".join(out)


def images_counted(text: str, image: str | None, fmt: str) -> str:
    """Each run of an image's tokens (the processor's placeholder, repeated as many times as
    the image has tokens, never trained) shown once with its count: `<image>x16`."""
    if not image:
        return text
    import re

    token = re.escape(_escape(image, fmt))
    return re.sub(f"(?:{token})+", lambda m: f"{m.group(0)[:len(_escape(image, fmt))]}"
                  f"x{len(m.group(0)) // len(_escape(image, fmt))}", text)


def _runs(flags: list[bool]) -> list[tuple[int, int, bool]]:
    """(start, end, flag) of each run of equal flags."""
    runs, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append((start, i, flags[start]))
            start = i
    return runs


def _escape(text: str, fmt: str) -> str:
    return html.escape(text, quote=False) if fmt == "html" else text
