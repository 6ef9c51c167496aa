"""`finetune show-rows` (tasks/show_rows.py): a tokenized split's first rows decoded with the
trained tokens marked, on a two-row split made here (prompt untrained, completion trained)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from helpers import ROOT, error_line, run_cli
from finetune.datatypes.encoding import IGNORE_INDEX
from finetune.errors import PipelineError
from finetune.workspace import Workspace
from tasks.show_rows import show_rows

ROWS = [("Question: 2 < 3?\nAnswer:", " Yes & so on."), ("Question: 4 plus 4?\nAnswer:", " 8.")]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    """A project folder (dvc.yaml marks its root) with the default params, the model, and
    data/tokenized/train only."""
    import datasets
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("rows")
    (root / "params").mkdir()
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    shutil.copy(ROOT / "params/default.yaml", root / "params/default.yaml")
    (root / "data").mkdir()
    (root / "data/models").symlink_to(ROOT / "data/models")
    tok = AutoTokenizer.from_pretrained(ROOT / "data/models/stories260K")
    columns = {"input_ids": [], "labels": []}
    for prompt, completion in ROWS:
        head = [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]
        tail = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        columns["input_ids"].append(head + tail)
        columns["labels"].append([IGNORE_INDEX] * len(head) + tail)
    datasets.Dataset.from_dict(columns).save_to_disk(str(root / "data/tokenized/train"))
    return dataclasses.replace(Workspace.load(ROOT / "params/default.yaml"), root=root,
                               params_path=root / "params/default.yaml")


def test_text_marks_exactly_the_trained_tokens(ws):
    assert show_rows(ws) == (
        "--- train row 0 ---\n<s> Question: 2 < 3?\nAnswer:⟦ Yes & so on.</s>⟧\n\n"
        "--- train row 1 ---\n<s> Question: 4 plus 4?\nAnswer:⟦ 8.</s>⟧")
    assert show_rows(ws, rows=1).count("--- train row") == 1
    assert show_rows(ws, rows=10).count("--- train row") == 2  # no more than the split has


def test_html_escapes_the_text_and_marks_the_trained_part(ws):
    assert show_rows(ws, rows=1, fmt="html") == (
        "<pre>--- train row 0 ---\n&lt;s&gt; Question: 2 &lt; 3?\n"
        "Answer:<mark> Yes &amp; so on.&lt;/s&gt;</mark></pre>")


def test_a_missing_split_is_one_line_naming_it(ws):
    with pytest.raises(PipelineError, match="data/tokenized/test missing: run the tokenize"):
        show_rows(ws, split="test")


def test_a_streamed_train_split_is_refused_with_why(tmp_path):
    streamed = dataclasses.replace(
        Workspace.load(ROOT / "params/default.yaml", ["data.streaming=true"]), root=tmp_path)
    with pytest.raises(PipelineError, match="tokenizes the train split on the fly.*--split test"):
        show_rows(streamed)


def test_the_cli_prints_rows_and_refuses_a_missing_split_with_exit_2(ws):
    proc = run_cli(ws.root, "show-rows", "--rows", "1", "--format", "html", check=True)
    assert proc.stdout.startswith("<pre>--- train row 0 ---\n") and "<mark> 8." not in proc.stdout
    assert "<mark> Yes &amp; so on.&lt;/s&gt;</mark></pre>" in proc.stdout
    line = error_line(run_cli(ws.root, "show-rows", "--split", "test"))
    assert "data/tokenized/test missing" in line, line
