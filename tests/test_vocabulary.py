"""A tokenizer other than the model's, added tokens (the vocabulary grows, embeddings train
with the adapter), and the pad token chosen when a tokenizer has none."""

from __future__ import annotations

import shutil

import torch
from helpers import ROOT, copy_project, train_in_place, write_params

from engine.modeling.model import choose_pad_token, load_tokenizer
from finetune.config.model import ModelConfig
from finetune.workspace import Workspace


def test_the_pad_token_is_never_eos_when_the_tokenizer_has_another():
    tok = load_tokenizer(ModelConfig(), ROOT)  # stories260K: no pad token, <unk> apart from EOS
    assert tok.pad_token == "<unk>" and tok.pad_token_id != tok.eos_token_id
    tok.unk_token = tok.eos_token  # a GPT-2-like tokenizer: nothing else exists
    assert choose_pad_token(tok) == tok.eos_token
    chosen = load_tokenizer(ModelConfig(special_tokens={"pad_token": "<pad>"}), ROOT)
    assert chosen.pad_token == "<pad>" and len(chosen) == 513  # a new token, as asked


def test_added_tokens_train_through_the_stages_and_ship_with_the_export(tmp_path):
    from tasks.download import download
    from tasks.evaluate import evaluate
    from tasks.export import export
    from tasks.format import format_prompts
    from tasks.tokenize import tokenize

    project = copy_project(tmp_path / "p")
    other = project / "data/models/other-tokenizer"  # "a tokenizer other than the model's"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(project / "data/models/stories260K" / name, other / name)
    write_params(project, {"model.tokenizer_name_or_path": "data/models/other-tokenizer",
                           "model.added_tokens": ["<|answer|>"],
                           "data.prompt_template": "Question: {question}\n<|answer|>",
                           "training.max_steps": 3, "registry.register_model": False,
                           "eval.generation_metrics": [], "eval.num_logged_samples": 0})
    ws = Workspace.load(project / "params/default.yaml")
    download(ws), format_prompts(ws), tokenize(ws)
    import datasets

    row = datasets.load_from_disk(str(project / "data/tokenized/train"))[0]
    assert 512 in row["input_ids"] and 512 not in row["labels"]  # in the prompt, not trained
    train_in_place(project)
    from safetensors.torch import load_file

    saved = load_file(str(project / "data/trained/adapter_model.safetensors"))
    embed = [k for k in saved if "embed_tokens" in k]
    assert embed and saved[embed[0]].shape[0] == 513, list(saved)
    base = load_tokenizer(ModelConfig(), ROOT)
    start = torch.stack([saved[embed[0]][:512].mean(0)])
    assert not torch.equal(saved[embed[0]][512:], start), "the new row did not train"
    evaluate(ws), export(ws)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(project / "data/export")
    tok = AutoTokenizer.from_pretrained(project / "data/export")
    assert exported.get_input_embeddings().weight.shape[0] == 513 == len(tok) == len(base) + 1
    assert tok.convert_tokens_to_ids("<|answer|>") == 512
    assert torch.equal(exported.get_input_embeddings().weight[512], saved[embed[0]][512])
    # stories260K ties its input and output embeddings: still one weight after the merge
    assert exported.config.tie_word_embeddings
    assert torch.equal(exported.get_output_embeddings().weight, exported.get_input_embeddings(
        ).weight)


def test_the_seeds_data_tokenizer_name_is_the_model_tokenizer():
    from finetune.config.schema import FinetuneConfig

    data = {"json_file_path": "x.jsonl"}
    cfg = FinetuneConfig.model_validate({"data": {**data, "tokenizer_name": "gpt2"}})
    assert cfg.model.tokenizer_name_or_path == "gpt2"
    import pytest

    with pytest.raises(ValueError, match="data.tokenizer_name 'gpt2' and "
                       "model.tokenizer_name_or_path 'other' differ"):
        FinetuneConfig.model_validate({"data": {**data, "tokenizer_name": "gpt2"},
                                       "model": {"tokenizer_name_or_path": "other"}})
