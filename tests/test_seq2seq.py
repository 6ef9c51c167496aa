"""Encoder-decoder (T5-style) models: `data.dataset_type: seq2seq` (AutoModelForSeq2SeqLM,
peft.task_type SEQ_2_SEQ_LM). The prompt is the encoder's input and the completion the labels,
unshifted; through the decoder-only loss a T5 would pass the start-up checks and learn the
wrong objective, so the loss is checked against the model's own `labels=` loss, and the train
(one process and 2-process DDP), evaluate and export stages run on a tiny random T5. A model
of the other kind than the type trains is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import copy_project, error_line, losses, run_cli, stages_here, write_params
from finetune.errors import PipelineError

WHY = "an encoder-decoder (T5-style) model reads the prompt in its encoder"
T5_DIR = "data/models/tiny-t5"


def _tiny_t5(project: Path) -> str:
    """A random 1+1-layer T5 (d_model 32), seeded, with the shipped model's tokenizer (its
    pad 0 starts the decoder, as in T5)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    dest = project / T5_DIR
    config = T5Config(vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                      num_decoder_layers=1, num_heads=4, pad_token_id=0, eos_token_id=2,
                      decoder_start_token_id=0)
    T5ForConditionalGeneration(config).save_pretrained(dest)
    src = project / "data/models/stories260K"
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / name, dest / name)
    return T5_DIR


S2S = {"data.dataset_type": "seq2seq", "model.name_or_path": T5_DIR,
       "training.max_steps": 12, "optimizer.learning_rate": 0.01, "logging.logging_steps": 1,
       "data.max_seq_length": 128, "registry.register_model": False}


@pytest.fixture(scope="module")
def tokenized_s2s(tmp_path_factory) -> Path:
    """A project with a tiny T5 and its seq2seq rows tokenized (download/format/tokenize)."""
    project = copy_project(tmp_path_factory.mktemp("s2s") / "p")
    _tiny_t5(project)
    write_params(project, S2S)
    stages_here(project, "download", "format", "tokenize")
    return project


def test_our_loss_equals_the_models_own_loss(tokenized_s2s):
    """Summed unshifted cross entropy / target count == T5(input_ids, labels=...).loss on the
    same batch of rows whose prompts and completions differ in length."""
    import datasets
    from transformers import T5ForConditionalGeneration

    from engine.datapath.data import count_targets, model_inputs, take_rows
    from engine.kinds.seq2seq_lm import Seq2SeqLoss, collate_seq2seq

    split = datasets.load_from_disk(str(tokenized_s2s / "data/tokenized/train"))
    rows = take_rows(split, range(4))
    assert len({len(r["labels"]) for r in rows}) > 1
    assert any(len(r["input_ids"]) != len(r["labels"]) for r in rows)
    model = T5ForConditionalGeneration.from_pretrained(tokenized_s2s / T5_DIR).eval()
    batch = collate_seq2seq(rows, pad_id=0, start_id=0)
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["labels"]).loss
        ours = Seq2SeqLoss().loss_sum(model(**model_inputs(batch)), batch["labels"])
    n = count_targets(batch)
    assert n == sum(len(r["labels"]) for r in rows)
    assert abs(float(ours) / n - float(own)) < 1e-5, (float(ours) / n, float(own))


def test_seq2seq_trains_evaluates_and_exports(tokenized_s2s, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(tokenized_s2s, project, symlinks=True)
    stages_here(project, "train", "evaluate", "export")
    curve = losses(project)
    assert len(curve) == 12 and curve[-1] < curve[0] - 0.5, curve
    evaluation = json.loads((project / "data/metrics/eval.json").read_text())
    base, tuned = evaluation["base"]["loss"], evaluation["finetuned"]["loss"]
    assert tuned < base - 0.5, evaluation
    samples = json.loads((project / "data/eval/samples.json").read_text())
    prompt = samples[0]["prompt"]
    assert samples and not samples[0]["generation"].startswith(prompt.strip()[:20]), samples[0]
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    exported = AutoModelForSeq2SeqLM.from_pretrained(project / "data/export")
    assert type(exported).__name__ == "T5ForConditionalGeneration"
    tok = AutoTokenizer.from_pretrained(project / "data/export")
    ids = tok([prompt], add_special_tokens=False)["input_ids"]
    out = exported.generate(input_ids=torch.tensor(ids), max_new_tokens=4, do_sample=False,
                            eos_token_id=tok.eos_token_id)
    assert out.shape[1] <= 5  # the decoder's tokens alone, after its start token
    from engine.kinds.seq2seq_lm import Seq2SeqLM
    from engine.rollout.greedy import greedy_generate

    ours = greedy_generate(exported, tok, ids, batch_size=1, max_new_tokens=4,
                           generated_from=Seq2SeqLM().generated_from)
    row = out[0, 1:].tolist()
    row = row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
    assert ours == [tok.decode(row, skip_special_tokens=True)], (ours, out)


@pytest.mark.distributed
def test_seq2seq_trains_with_ddp_on_two_processes(tokenized_s2s, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(tokenized_s2s, project, symlinks=True)
    write_params(project, {"distributed.strategy": "ddp", "distributed.nproc_per_node": 2,
                           "training.per_device_train_batch_size": 2})
    stages_here(project, "train")
    curve = losses(project)
    assert len(curve) == 12 and curve[-1] < curve[0] - 0.5, curve
    metrics = json.loads((project / "data/metrics/train.json").read_text())
    assert metrics["global_step"] == 12, metrics


def test_a_model_of_the_other_kind_is_refused_in_one_line(tokenized_s2s):
    project = tokenized_s2s
    line = error_line(run_cli(project, "validate", "--set", "data.dataset_type=completion"))
    assert f"model.name_or_path {T5_DIR}: a t5 model: {WHY}" in line, line
    line = error_line(run_cli(project, "validate", "--set",
                             "model.name_or_path=data/models/stories260K"))
    assert "data.dataset_type seq2seq trains an encoder-decoder model" in line, line
    for key, value in (("training.packing", "true"), ("training.type", "dpo"),
                       ("training.type", "grpo"), ("registry.register_model", "true")):
        line = error_line(run_cli(project, "validate", "--set", f"{key}={value}"))
        assert key in line, line


def test_loader_refuses_a_t5_named_by_class(tokenized_s2s):
    """`module:Class` skips the config's model task; the loaded model's config is what tells."""
    from engine.modeling.model import load_base_model
    from finetune.config.model import ModelConfig

    cfg = ModelConfig(name_or_path=T5_DIR,
                      auto_class_name="transformers:T5ForConditionalGeneration")
    with pytest.raises(PipelineError) as refused:
        load_base_model(cfg, tokenized_s2s)
    assert str(refused.value).startswith(f"model.name_or_path {T5_DIR}: a t5 model: {WHY}")
