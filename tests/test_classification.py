"""Classification datasets: a label map from the data, a sequence classifier with LoRA and a
trainable head, accuracy and macro-F1 in evaluate, the registry gated on accuracy."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from finetune.config.schema import FinetuneConfig
from finetune.datatypes.metrics import classification_metrics
from helpers import copy_project, refused_here, stages_here, write_params

WORDS = {"positive": "good", "negative": "bad"}


def _rows(n: int) -> list[dict]:
    """The class is the last word: learnable by a tiny model in a few dozen steps."""
    fillers = ["the film was", "my day felt", "that meal tasted", "this song is"]
    rows = []
    for i in range(n):
        label = "positive" if (i // 4) % 2 == 0 else "negative"  # each filler with each label
        rows.append({"review": f"{fillers[i % 4]} {WORDS[label]}", "sentiment": label})
    return rows


def _tiny_model(project):
    """A 2-layer Llama made here (random, seeded) with the shipped model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    src = project / "data/models/stories260K"
    dest = project / "data/models/tiny-classifier"
    dest.mkdir(parents=True)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / name, dest / name)
    return "data/models/tiny-classifier"


def test_classification_config_derives_the_classifier_and_refuses_lm_keys():
    base = {"data": {"dataset_type": "classification", "json_file_path": "x.jsonl"}}
    cfg = FinetuneConfig.model_validate(base)
    assert cfg.model.auto_class_name == "AutoModelForSequenceClassification"
    assert cfg.peft.task_type == "SEQ_CLS"
    assert FinetuneConfig.model_validate(
        {"data": {"json_file_path": "x.jsonl"}}).peft.task_type == "CAUSAL_LM"
    alias = {"data": {**base["data"], "target_column": "sentiment"}}
    assert FinetuneConfig.model_validate(alias).data.label_column == "sentiment"
    bad = [
        ({"training": {"packing": True}}, "training.packing: true does not combine with a "
         "classification dataset"),
        ({"eval": {"generation_metrics": ["rouge"]}}, r'eval.generation_metrics: \["rouge"\] '
         "does not combine with a classification dataset"),
        ({"model": {"auto_class_name": "AutoModelForCausalLM"}}, "model.auto_class_name: "
         "AutoModelForCausalLM does not fit data.dataset_type classification"),
        ({"data": {**base["data"], "completion_template": "{x}"}},
         "completion_template does not apply to dataset_type classification"),
        ({"data": {**base["data"], "labels": ["a", "a"]}}, "repeats a class name"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            FinetuneConfig.model_validate({**base, **extra})
    with pytest.raises(ValueError, match="registry.gate_metric eval.accuracy is not reported "
                       "for data.dataset_type completion"):
        FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"},
                                       "registry": {"gate_metric": "eval.accuracy"}})


def test_macro_f1_weighs_each_class_equally():
    # always "0" on 3:1 data: 75% accuracy, but class 1 is never found
    scores = classification_metrics([0, 0, 0, 0], [0, 0, 0, 1], 2)
    assert scores["accuracy"] == 0.75
    assert scores["macro_f1"] == pytest.approx((6 / 7 + 0) / 2)
    assert classification_metrics([1, 0], [1, 0], 2) == {"accuracy": 1.0, "macro_f1": 1.0}


def test_a_classification_dataset_runs_through_all_six_stages(tmp_path):
    project = copy_project(tmp_path / "p")
    model = _tiny_model(project)
    data = project / "data/reviews.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _rows(80)) + "\n")
    write_params(project, {"model.name_or_path": model,
                           "data.dataset_type": "classification",
                           "data.data_files": {"train": "data/reviews.jsonl"},
                           "data.prompt_template": None, "data.completion_template": None,
                           "data.label_column": "sentiment", "data.split_ratio": 0.75,
                           "data.max_train_samples": None, "data.max_eval_samples": None,
                           "data.max_seq_length": 32,
                           "training.max_steps": 40, "optimizer.learning_rate": 0.01,
                           "eval.generation_metrics": [],
                           "registry.gate_metric": "eval.accuracy"})
    stages_here(project, "download", "format", "tokenize", "train", "evaluate", "export")
    names = json.loads((project / "data/formatted/labels.json").read_text())
    assert names == ["negative", "positive"]  # sorted distinct labels of the train split
    test = pd.read_parquet(project / "data/formatted/test.parquet")
    assert len(test) == 20 and set(test["completion"]) == {"negative", "positive"}
    evaluation = json.loads((project / "data/metrics/eval.json").read_text())
    tuned, base = evaluation["finetuned"], evaluation["base"]
    # the base model's head is untrained (its accuracy is chance, which on two words may be
    # anything): the loss says the training learned
    assert tuned["accuracy"] >= 0.9 and tuned["macro_f1"] >= 0.9, evaluation
    assert tuned["loss"] < base["loss"] / 10, evaluation
    # accuracy's bootstrap stderr over the 20 rows (at most the binomial's at 1/2, 0.11);
    # macro-F1 is of the whole set: none
    assert 0 <= tuned["accuracy_stderr"] < 0.12 and "macro_f1_stderr" not in tuned, evaluation
    samples = json.loads((project / "data/eval/samples.json").read_text())
    assert samples[0]["reference"] in names and "prediction" in samples[0]
    config = json.loads((project / "data/export/config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    version = json.loads((project / "data/lineage/model_version.json").read_text())
    assert version["promoted"] and version["gate_metric"] == "eval.accuracy", version
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    exported = AutoModelForSequenceClassification.from_pretrained(project / "data/export")
    tok = AutoTokenizer.from_pretrained(project / "data/export")
    ids = tok(["the film was good", "the film was bad"], add_special_tokens=True,
              return_tensors="pt", padding=True)
    predicted = exported(**ids).logits.argmax(-1).tolist()
    assert [exported.config.id2label[i] for i in predicted] == ["positive", "negative"]
    # a test label outside the map: one line naming split, row and column; nothing rewritten
    rows = _rows(80)
    write_params(project, {"data.labels": ["negative", "positive"]})
    rows[3]["sentiment"] = "neutral"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    stages_here(project, "download")
    before = (project / "data/formatted/train.parquet").read_bytes()
    line = refused_here(project, "format")
    assert "data.label_column 'sentiment'" in line and "has label 'neutral'" in line, line
    assert "row" in line and "not in the label map (negative, positive)" in line, line
    assert (project / "data/formatted/train.parquet").read_bytes() == before
