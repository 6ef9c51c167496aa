"""Encoder-decoder (T5-style, peft.task_type SEQ_2_SEQ_LM) models are refused, in one line,
by every path that names one: the two config keys (rows of finetune/config/compat.py), a model
folder whose config.json is encoder-decoder (`finetune validate`, before any launch), and a
model class the config cannot see through (the loader). Training one through the decoder-only
loss would pass the start-up checks and learn the wrong objective, so refusing is the honest
answer until the label layout is supported."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import error_line, run_cli
from finetune.errors import PipelineError

WHY = "encoder-decoder (T5-style) models are not supported yet"


def _tiny_t5(folder: Path) -> Path:
    """A random 1+1-layer T5 (d_model 32), saved as a model folder."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                      num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)
    T5ForConditionalGeneration(config).save_pretrained(folder)
    return folder


def test_validate_refuses_seq2seq_keys_and_a_t5_folder_in_one_line(project, tmp_path):
    params = (project / "params/default.yaml").read_text()
    for key, value in (("peft.task_type", "SEQ_2_SEQ_LM"),
                       ("model.auto_class_name", "AutoModelForSeq2SeqLM")):
        line = error_line(run_cli(project, "validate", "--set", f"{key}={value}"))
        assert f"{key}: {value}: {WHY}" in line, line
    t5 = _tiny_t5(tmp_path / "t5")
    line = error_line(run_cli(project, "validate", "--set", f"model.name_or_path={t5}"))
    assert f"model.name_or_path {t5}: a t5 model: {WHY}" in line, line
    assert (project / "params/default.yaml").read_text() == params  # nothing written
    run_cli(project, "validate", check=True)  # the decoder-only default still validates


def test_loader_refuses_a_t5_named_by_class(tmp_path):
    """`module:Class` skips the config rows; the loaded model's config is what tells."""
    from engine.modeling.model import load_base_model
    from finetune.config.model import ModelConfig

    t5 = _tiny_t5(tmp_path / "t5")
    cfg = ModelConfig(name_or_path=str(t5),
                      auto_class_name="transformers:T5ForConditionalGeneration")
    with pytest.raises(PipelineError) as refused:
        load_base_model(cfg, tmp_path)
    assert str(refused.value).startswith(f"model.name_or_path {t5}: a t5 model: {WHY}")
