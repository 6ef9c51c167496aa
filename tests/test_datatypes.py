"""Dataset types as one interface (finetune/datatypes): names and aliases, keys that belong to
another type, rows with nothing to learn dropped and counted, every type streamed and mixed,
and a project's own type as one module written here, in the test."""

from __future__ import annotations

import json
import textwrap

import datasets
import pandas as pd
import pytest

from helpers import (copy_project, error_line, refused_here, run_cli, stages_here, train_here,
                     train_metrics, write_params)
from finetune.config import load_config
from finetune.config.data import DataConfig
from finetune.errors import PipelineError

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant: {% endif %}")
NO_TEMPLATES = {"prompt_template": None, "completion_template": None}
GSM8K = {"train": "data/source/gsm8k/train.jsonl", "test": "data/source/gsm8k/test.jsonl"}
#: one source of each type, from the shipped GSM8K-derived files
TYPES = {
    "completion": {"data_files": GSM8K},
    "text": {**NO_TEMPLATES, "dataset_type": "text", "text_field": "answer",
             "data_files": GSM8K},
    "chat": {**NO_TEMPLATES, "dataset_type": "chat", "chat_template": CHAT_TEMPLATE,
             "data_files": {"train": "data/source/gsm8k-chat/train.jsonl",
                            "test": "data/source/gsm8k-chat/test.jsonl"}},
    "classification": {**NO_TEMPLATES, "dataset_type": "classification",
                       "text_field": "question", "label_column": "steps",
                       "labels": ["short", "long"],
                       "data_files": {"train": "data/source/gsm8k-steps/train.jsonl",
                                      "test": "data/source/gsm8k-steps/test.jsonl"}},
}
SMALL = {"data.max_train_samples": 24, "data.max_eval_samples": 8}
#: what a classifier's params also change (it does not generate)
NO_GENERATION = {"eval.generation_metrics": []}


def one_source(kind: str) -> dict:
    return {**{f"data.{k}": v for k, v in TYPES[kind].items()},
            **(NO_GENERATION if kind == "classification" else {})}


def _stored(project, split="train") -> list[dict]:
    rows = datasets.load_from_disk(str(project / f"data/tokenized/{split}"))
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]


def _streamed(project, overrides: dict) -> list[dict]:
    """The train stream's first epoch, opened as the workers open it (in the project)."""
    import os

    from tasks.stream import open_train_stream

    write_params(project, overrides)
    here = os.getcwd()
    os.chdir(project)
    try:
        return list(open_train_stream(load_config(project / "params/default.yaml"), project)(0))
    finally:
        os.chdir(here)


# -- names, keys, defaults --------------------------------------------------------------------

def test_names_aliases_and_a_did_you_mean():
    base = {"json_file_path": "x.jsonl"}
    assert DataConfig(**base, dataset_type="seq_completion").dataset_type == "completion"
    assert DataConfig(**base, dataset_type="sharegpt").datatype.name == "chat"
    with pytest.raises(ValueError, match="unknown dataset type 'chta' \\(did you mean 'chat'"):
        DataConfig(**base, dataset_type="chta")
    with pytest.raises(ValueError, match="is not a finetune.datatypes.DatasetType subclass"):
        DataConfig(**base, dataset_type="finetune.config.data:DataConfig")
    assert DataConfig(**base, dataset_type="classification").task.classifier
    assert not DataConfig(**base).task.classifier
    # a type that leaves an abstract step out is refused when named, not at its stage
    with pytest.raises(ValueError, match="'finetune.datatypes.base:DatasetType' does not "
                       "implement encoder, format"):
        DataConfig(**base, dataset_type="finetune.datatypes.base:DatasetType")


def test_the_template_defaults_step_aside_for_a_users_own_choice():
    """The GSM8K templates are defaults for a file that says nothing about how rows become
    text: a prompt function, a text field or another type replaces them instead of clashing."""
    base = {"json_file_path": "x.jsonl"}
    assert DataConfig(**base).prompt_template == "Question: {question}\nAnswer:"
    func = DataConfig(**base, prompt_func="m:f", completion_template="{output}")
    assert func.prompt_template is None and func.completion_template == "{output}"
    # the text field is used whatever the type it is given to: a completion without templates
    # trains on it; with a template set by hand it would be unused: refused
    text = DataConfig(**base, text_field="body")
    assert text.datatype.plain_text and text.datatype.required_columns() == ["body"]
    with pytest.raises(ValueError, match="text_field names the column trained on"):
        DataConfig(**base, text_field="body", prompt_template="{q}", completion_template="{a}")
    classes = DataConfig(**base, dataset_type="classification")
    assert classes.prompt_template is None  # the input is the detected text column
    with pytest.raises(ValueError, match="does not apply to dataset_type chat"):
        DataConfig(**base, dataset_type="chat", prompt_template="{q}")


def test_a_source_of_its_own_type_inherits_no_templates():
    """The data section's templates are the default for sources that say nothing about text;
    a chat source or one with its own prompt function does not inherit them."""
    data = DataConfig(prompt_template="Q: {q}", completion_template=" {a}", sources=[
        {"name": "qa", "json_file_path": "a.jsonl"},
        {"name": "chat", "json_file_path": "b.jsonl", "dataset_type": "chat"},
        {"name": "fn", "json_file_path": "c.jsonl", "prompt_func": "m:f",
         "completion_template": "{out}"}])
    parts = dict(data.parts())
    assert parts["qa"].prompt_template == "Q: {q}"
    assert parts["chat"].datatype.name == "chat"
    assert parts["fn"].prompt_template is None and parts["fn"].completion_template == "{out}"


def test_the_seeds_dataset_section_name(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("dataset:\n  dataset_type: seq_completion\n  json_file_path: a.jsonl\n"
                    "  tokenizer_name: some/tokenizer\n")
    cfg = load_config(path)
    assert cfg.data.dataset_type == "completion"
    assert cfg.model.tokenizer_name_or_path == "some/tokenizer"
    path.write_text("data:\n  json_file_path: a.jsonl\ndataset:\n  json_file_path: b.jsonl\n")
    with pytest.raises(PipelineError, match="both a data: and a dataset: section"):
        load_config(path)


# -- rows with nothing to learn ---------------------------------------------------------------

def _alpaca_rows(n: int, empty: dict[int, str]) -> list[dict]:
    return [{"instruction": f"Add {i} and {i + 1}.", "input": "",
             "output": empty.get(i, f"{2 * i + 1}")} for i in range(n)]


def _jsonl(project, name: str, rows: list[dict]) -> str:
    path = project / "data/source" / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"data/source/{name}"


ALPACA = {**{f"data.{k}": None for k in NO_TEMPLATES}, "data.prompt_func": None,
          "data.prompt_template": "### Instruction:\n{instruction}\n\n### Response:\n",
          "data.completion_template": "{output}", "data.max_train_samples": None,
          "data.max_eval_samples": None}


def test_alpaca_rows_with_empty_outputs_are_dropped_and_counted(tmp_path):
    """The public Alpaca data has rows whose output is empty: format drops them (empty and
    whitespace-only), counts them in format.json and trains on the rest; above
    data.max_dropped_fraction it fails with one line and keeps the previous outputs."""
    project = copy_project(tmp_path / "p")
    files = {"train": _jsonl(project, "alpaca-train.jsonl", _alpaca_rows(40, {7: "", 21: "  "})),
             "test": _jsonl(project, "alpaca-test.jsonl", _alpaca_rows(10, {}))}
    write_params(project, {**ALPACA, "data.data_files": files, "data.max_dropped_fraction": 0.05})
    stages_here(project, "download", "format", "tokenize")
    counts = json.loads((project / "data/metrics/format.json").read_text())
    assert counts == {"train": {"rows": 38, "dropped_rows": 2},
                      "test": {"rows": 10, "dropped_rows": 0}}
    train = pd.read_parquet(project / "data/formatted/train.parquet")
    assert len(train) == 38 and (train.completion.str.strip() != "").all()
    assert "Add 7 and 8." not in "".join(train.prompt)
    assert json.loads((project / "data/metrics/tokenize.json").read_text())["train"]["rows"] == 38

    before = (project / "data/formatted/train.parquet").read_bytes()
    _jsonl(project, "alpaca-train.jsonl", _alpaca_rows(40, {3: "", 7: "", 21: " \n"}))
    stages_here(project, "download")
    assert refused_here(project, "format") == (
        "format split 'train': 3/40 rows have empty completion (first: row 3); above "
        "data.max_dropped_fraction 0.05: clean the data or raise data.max_dropped_fraction")
    assert (project / "data/formatted/train.parquet").read_bytes() == before


def test_empty_assistant_turns_and_unlabeled_rows_are_dropped_and_counted(tmp_path):
    project = copy_project(tmp_path / "p")
    chat = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": "" if i == 2 else f"a{i}"}]}
            for i in range(10)] + [{"messages": []}]
    write_params(project, {**one_source("chat"), **SMALL, "data.max_dropped_fraction": 0.34,
                           "data.data_files": {"train": _jsonl(project, "c.jsonl", chat),
                                               "test": _jsonl(project, "ct.jsonl", chat[:3])}})
    stages_here(project, "download", "format")
    counts = json.loads((project / "data/metrics/format.json").read_text())
    empty = "no messages or an empty assistant turn"  # the chat type counts by reason
    assert counts["train"] == {"rows": 9, "dropped_rows": 2, "dropped_by_reason": {empty: 2}}
    assert counts["test"] == {"rows": 2, "dropped_rows": 1, "dropped_by_reason": {empty: 1}}

    rows = [{"question": f"q{i}", "steps": None if i == 4 else ("short", "long")[i % 2]}
            for i in range(12)]
    write_params(project, {**one_source("classification"), "data.labels": None,
                           "data.chat_template": None,
                           "data.data_files": {"train": _jsonl(project, "k.jsonl", rows),
                                               "test": _jsonl(project, "kt.jsonl", rows[:6])}})
    stages_here(project, "download", "format")
    counts = json.loads((project / "data/metrics/format.json").read_text())
    assert counts["train"] == {"rows": 11, "dropped_rows": 1}
    assert json.loads((project / "data/formatted/labels.json").read_text()) == ["long", "short"]


# -- every type streamed and mixed ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["text", "chat", "classification"])
def test_every_type_streams_the_examples_its_stages_make(tmp_path, kind):
    """A streamed train split goes through the type's own format and encoder: in stream order
    it is the tokenize stage's split, token for token (completion: tests/test_streaming.py)."""
    project = copy_project(tmp_path / "p", {**one_source(kind), **SMALL})
    stages_here(project, "download", "format", "tokenize")
    stored = _stored(project)
    assert len(stored) >= 20
    assert _streamed(project, {"data.streaming": True, "data.shuffle_buffer": 1}) == stored


MIXTURE = [
    {"name": "qa", **TYPES["completion"], "max_train_samples": 16,
     "max_eval_samples": 4},
    {"name": "chat", **TYPES["chat"], "max_train_samples": 8, "max_eval_samples": 4},
    {"name": "text", **TYPES["text"], "max_train_samples": 8, "max_eval_samples": 4},
]
MIXED = {"data.data_files": None, "data.sources": MIXTURE, "data.max_train_samples": None,
         "data.max_eval_samples": None}


def test_a_streamed_mixture_is_its_stages_mixture_and_trains(tmp_path):
    """Completion, chat and text sources in one run: streamed and concatenated they are the
    tokenize stage's mixture; streamed and interleaved (weights, seeded) they train."""
    project = copy_project(tmp_path / "p", MIXED)
    stages_here(project, "download", "format", "tokenize")
    stored = _stored(project)
    counts = json.loads((project / "data/metrics/tokenize.json").read_text())["sources"]
    assert len(stored) == sum(c["train"]["rows"] for c in counts.values()) >= 28
    streamed = _streamed(project, {"data.streaming": True, "data.shuffle_buffer": 1})
    assert streamed == stored

    weighted = [{**MIXTURE[0], "weight": 2.0}, *MIXTURE[1:]]
    write_params(project, {"data.mixing": "interleave", "data.stopping_strategy": "all_exhausted",
                           "data.shuffle_buffer": 8, "data.sources": weighted})
    stages_here(project, "download", "format", "tokenize")
    manifest = json.loads((project / "data/tokenized/stream.json").read_text())
    assert set(manifest["sources"]) == {"qa", "chat", "text"}
    assert manifest["mixing"] == "interleave" and manifest["weights"]["qa"] == 2.0
    assert len(_stored(project, "test")) == 12  # each source's held-out rows, materialised
    interleaved = _streamed(project, {})
    assert {str(x) for x in interleaved} == {str(x) for x in streamed}  # every row, reordered
    assert interleaved != streamed
    _, proc = train_here(project, tmp_path / "run", {
        "training.max_steps": 3, "checkpoint.save_strategy": "no", "eval.eval_steps": 3})
    assert "3 steps (streamed)" in proc.stdout
    assert train_metrics(tmp_path / "run")["global_step"] == 3


def test_classification_sources_mix_into_one_label_map_and_stream(tmp_path):
    """Two classification sources: one label map from both train splits, mixed map-style and
    streamed (the stream needs data.labels: it cannot be read whole for them first)."""
    steps = TYPES["classification"]
    sources = [{"name": "a", **steps, "train_split": "train[:120]", "max_eval_samples": 6},
               {"name": "b", **steps, "train_split": "train[120:200]", "max_eval_samples": 6,
                "data_files": {"train": steps["data_files"]["train"]}, "test_split": None}]
    for source in sources:
        source.pop("labels")
    mixture = {"data.data_files": None, "data.sources": sources, "data.max_train_samples": None,
               "data.max_eval_samples": None, "registry.gate_metric": "eval.accuracy",
               "eval.generation_metrics": [], **{f"data.{k}": None for k in NO_TEMPLATES}}
    project = copy_project(tmp_path / "p", mixture)
    stages_here(project, "download", "format", "tokenize")
    assert json.loads((project / "data/tokenized/labels.json").read_text()) == ["long", "short"]
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    assert stats["sources"]["b"]["train"]["rows"] == 80 and stats["test"]["rows"] == 6

    with pytest.raises(PipelineError, match="a streamed classification dataset needs its "
                       "classes in data.labels"):
        load_config(project / "params/default.yaml", overrides=["data.streaming=true"])
    write_params(project, {"data.streaming": True, "data.labels": ["long", "short"],
                           "data.shuffle_buffer": 16})
    stages_here(project, "download", "format", "tokenize")
    _, proc = train_here(project, tmp_path / "run", {
        "training.max_steps": 2, "checkpoint.save_strategy": "no", "eval.eval_steps": 2})
    assert "2 steps (streamed)" in proc.stdout


# -- a project's own type: one module -------------------------------------------------------

SUMMARY_TYPE = '''
"""A document and its summary (a type written by a project, not shipped)."""
import pandas as pd

from finetune.datatypes import DatasetType, Formatted
from finetune.datatypes.encoding import encode_pairs
from finetune.datatypes.metrics import rouge


class SummaryType(DatasetType):
    name = "summary"

    def required_columns(self):
        return ["document", "summary"]

    def format(self, frame, split, ctx, first_row=0):
        rows = pd.DataFrame({"prompt": [f"Summarize: {d}\\nSummary:" for d in frame.document],
                             "completion": [f" {s}" for s in frame.summary]})
        return Formatted.without_empty(rows, first_row, "an empty summary")

    def encoder(self, ctx):
        return encode_pairs, {"bos": ctx.bos, "max_len": self.data.max_seq_length}

    def reported_metrics(self):
        return ("loss", "perplexity", "rouge1", "rouge2", "rougeL")

    def score(self, predictions, references, ev, ctx):
        return rouge(predictions, references)
'''


def test_a_projects_own_type_is_one_module(tmp_path):
    """The type above, named by path in the params file, runs download to evaluate (and
    streamed): the stages needed nothing but the module."""
    project = copy_project(tmp_path / "p")
    (project / "mytypes").mkdir()
    (project / "mytypes/summary.py").write_text(textwrap.dedent(SUMMARY_TYPE))
    rows = pd.read_json(project / "data/source/gsm8k/train.jsonl", lines=True).head(30)
    docs = [{"document": q, "summary": a.split("####")[-1].strip()}
            for q, a in zip(rows.question, rows.answer)]
    files = {"train": _jsonl(project, "sum.jsonl", docs[:24]),
             "test": _jsonl(project, "sum-test.jsonl", docs[24:])}
    write_params(project, {**{f"data.{k}": None for k in NO_TEMPLATES}, "data.data_files": files,
                           "data.dataset_type": "mytypes/summary:SummaryType",
                           "eval.generation_metrics": ["rouge"], "registry.gate_metric":
                           "eval.rougeL", "eval.max_generation_samples": 3,
                           "eval.generation_max_new_tokens": 8})
    stages_here(project, "download", "format", "tokenize")
    formatted = pd.read_parquet(project / "data/formatted/train.parquet")
    assert formatted.prompt[0].startswith("Summarize: ") and len(formatted) == 24
    assert _streamed(project, {"data.streaming": True, "data.shuffle_buffer": 1}) == _stored(
        project)
    write_params(project, {"data.streaming": False})
    run, _ = train_here(project, tmp_path / "run", {"training.max_steps": 2,
                                                    "checkpoint.save_strategy": "no"})
    stages_here(run, "evaluate")
    scores = json.loads((run / "data/metrics/eval.json").read_text())["finetuned"]
    assert {"loss", "rouge1", "rougeL"} <= set(scores) and "exact_match" not in scores
    # a key only another type reads is refused for it, as for the built-in types
    proc = run_cli(project, "validate", "-s", "data.messages_field=msgs")
    assert "messages_field does not apply to dataset_type mytypes/summary:SummaryType" in (
        error_line(proc))
