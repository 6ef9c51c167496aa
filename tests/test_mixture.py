"""Two sources of different types mixed into one run (`data.sources`)."""

from __future__ import annotations

import json

import pytest

from finetune.config.data import DataConfig
from tasks.tracking import data_hashes
from helpers import copy_project, refused_here, run_cli, stages_here, write_params

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant: {% endif %}")
SOURCES = [
    {"name": "qa", "weight": 3.0, "data_files": {"train": "data/source/gsm8k/train.jsonl",
                                                 "test": "data/source/gsm8k/test.jsonl"},
     "max_train_samples": 30, "max_eval_samples": 6},
    {"name": "chat", "weight": 1.0, "dataset_type": "chat", "prompt_template": None,
     "completion_template": None, "chat_template": CHAT_TEMPLATE,
     "data_files": {"train": "data/source/gsm8k-chat/train.jsonl",
                    "test": "data/source/gsm8k-chat/test.jsonl"},
     "max_train_samples": 10, "max_eval_samples": 4},
]
MIXTURE = {"data.data_files": None, "data.sources": SOURCES, "data.mixing": "interleave",
           "data.stopping_strategy": "all_exhausted", "data.max_train_samples": None,
           "data.max_eval_samples": None}


def test_mixture_config_errors_name_the_source():
    two = [{"name": "a", "json_file_path": "a.jsonl"}, {"name": "b", "json_file_path": "b.jsonl"}]
    assert [n for n, _ in DataConfig(sources=two).parts()] == ["a", "b"]
    assert DataConfig(json_file_path="x.jsonl").parts()[0][0] is None  # one source: as before
    cases = [
        ({"sources": [two[0], {**two[1], "weight": 0}]}, "greater than 0"),
        ({"sources": [two[0], {**two[1], "weight": 2}]}, "weights need mixing: interleave"),
        ({"sources": [two[0], {"name": "b"}]}, r"sources\[1\] \(b\): set exactly one of"),
        ({"sources": [two[0], {**two[1], "dataset_type": "chat", "prompt_template": "{q}"}]},
         r"sources\[1\] \(b\): prompt_template does not apply to dataset_type chat"),
        ({"sources": two, "json_file_path": "x.jsonl"}, "json_file_path is set next to "
         "data.sources"),
        ({"sources": [two[0], {**two[1], "name": "a"}]}, "names must differ"),
        ({"sources": [two[0], {**two[1], "dataset_type": "classification",
                               "prompt_template": None, "completion_template": None}]},
         r"sources\[1\] \(b\): dataset_type classification trains "
         "AutoModelForSequenceClassification, sources\\[0\\] AutoModelForCausalLM; the sources of a "
         "mixture train one model"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            DataConfig(**kwargs)


def test_a_two_source_mixture_runs_through_all_six_stages(tmp_path):
    project = copy_project(tmp_path / "p", MIXTURE)
    stages_here(project, "download", "format", "tokenize", "train", "evaluate", "export")
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    qa, chat = stats["sources"]["qa"], stats["sources"]["chat"]
    assert qa["train"]["rows"] + qa["train"]["dropped_rows"] == 30
    assert chat["train"]["rows"] + chat["train"]["dropped_rows"] == 10
    assert chat["test"]["rows"] + chat["test"]["dropped_rows"] == 4
    # interleaved 3:1 until every source was seen whole: qa whole, chat repeated
    assert qa["train"]["rows_in_mixture"] == qa["train"]["rows"]
    assert chat["train"]["rows_in_mixture"] > chat["train"]["rows"]
    assert stats["train"]["rows"] == qa["train"]["rows_in_mixture"] + chat["train"][
        "rows_in_mixture"]
    assert stats["test"]["rows"] == qa["test"]["rows"] + chat["test"]["rows"]  # concatenated
    hashes = data_hashes(project / "data/raw")
    assert {"data_sha256.qa", "data_sha256.chat", "data_sha256.chat/train.parquet"} <= set(hashes)
    evaluation = json.loads((project / "data/metrics/eval.json").read_text())
    assert evaluation["finetuned"]["loss"] < evaluation["base"]["loss"]
    assert (project / "data/export/config.json").exists()
    # seeded: tokenizing again gives the same bytes (the DVC hash is stable), in another
    # process (its own hash seed), so this one stays a CLI run
    tokenized = project / "data/tokenized/train"
    before = {p.name: p.read_bytes() for p in tokenized.iterdir()}
    run_cli(project, "stage", "tokenize", check=True)
    assert {p.name: p.read_bytes() for p in tokenized.iterdir()} == before
    # a source whose columns do not fit its type: one line naming the source; nothing touched
    broken = [SOURCES[0], {**SOURCES[1], "dataset_type": "completion", "chat_template": None,
                           "prompt_template": "{question}", "completion_template": " {answer}"}]
    write_params(project, {"data.sources": broken})
    raw_before = (project / "data/raw/qa/train.parquet").read_bytes()
    line = refused_here(project, "download")
    assert "source 'chat'" in line and "column 'question'" in line, line
    assert (project / "data/raw/qa/train.parquet").read_bytes() == raw_before


def test_an_eval_only_source_is_evaluated_on_and_never_trained_on(tmp_path):
    from finetune.workspace import Workspace
    from tasks.download import download
    from tasks.format import format_prompts
    from tasks.tokenize import tokenize

    project = copy_project(tmp_path / "p")
    held_out = [{"question": f"held {i}", "answer": f"#### {i}"} for i in range(7)]
    (project / "data/held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    write_params(project, {**MIXTURE, "data.mixing": "concatenate", "data.sources": [
        {"name": "qa", "data_files": {"train": "data/source/gsm8k/train.jsonl",
                                      "test": "data/source/gsm8k/test.jsonl"},
         "max_train_samples": 12, "max_eval_samples": 3},
        {"name": "held", "eval_only": True, "json_file_path": "data/held.jsonl"}]})
    ws = Workspace.load(project / "params/default.yaml")
    out = download(ws)
    assert "held/train" not in out and "held/test" in out
    format_prompts(ws), tokenize(ws)
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    assert "train" not in stats["sources"]["held"] and stats["sources"]["held"]["test"]["rows"] == 7
    assert stats["train"]["rows"] == stats["sources"]["qa"]["train"]["rows"]  # never trained on
    assert stats["test"]["rows"] == 7 + stats["sources"]["qa"]["test"]["rows"]
    with pytest.raises(ValueError, match="every source is eval_only"):
        DataConfig(sources=[{"name": "a", "json_file_path": "a", "eval_only": True},
                            {"name": "b", "json_file_path": "b", "eval_only": True}])
