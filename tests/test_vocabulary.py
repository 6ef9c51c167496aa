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
    """The default route under LoRA (peft.trainable_token_indices: added): the new row alone
    trains; the export's HF folder and GGUF file hold the token and its trained row, the old
    rows exactly the base model's."""
    from gguf import GGUFReader

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
                           "eval.generation_metrics": [], "eval.num_logged_samples": 0,
                           "export.formats": ["hf", "gguf"], "export.gguf": ["f32"],
                           "export.save_adapter": False})
    ws = Workspace.load(project / "params/default.yaml")
    download(ws), format_prompts(ws), tokenize(ws)
    import datasets

    row = datasets.load_from_disk(str(project / "data/tokenized/train"))[0]
    assert 512 in row["input_ids"] and 512 not in row["labels"]  # in the prompt, not trained
    train_in_place(project)
    from safetensors.torch import load_file

    saved = load_file(str(project / "data/trained/adapter_model.safetensors"))
    assert not any("modules_to_save" in k for k in saved), list(saved)
    delta = [k for k in saved if "trainable_tokens_delta" in k]
    # one row trains; the tied head's adapter saves the embedding's (the same tensor)
    assert [k.split(".")[-3] for k in delta] == ["lm_head", "embed_tokens"], list(saved)
    assert saved[delta[0]].shape == (1, 64) and torch.equal(saved[delta[0]], saved[delta[1]])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(ROOT / "data/models/stories260K")
    old = base.get_input_embeddings().weight.detach()
    assert not torch.equal(saved[delta[0]][0], old.mean(0)), "the new row did not train"
    evaluate(ws), export(ws)
    exported = AutoModelForCausalLM.from_pretrained(project / "data/export")
    tok = AutoTokenizer.from_pretrained(project / "data/export")
    embedding = exported.get_input_embeddings().weight.detach()
    assert embedding.shape[0] == 513 == len(tok) == len(load_tokenizer(ModelConfig(), ROOT)) + 1
    assert tok.convert_tokens_to_ids("<|answer|>") == 512
    assert torch.equal(embedding[512], saved[delta[0]][0])
    assert torch.equal(embedding[:512], old)  # the old rows did not move
    # stories260K ties its input and output embeddings: still one weight after the merge
    assert exported.config.tie_word_embeddings
    assert torch.equal(exported.get_output_embeddings().weight, embedding)
    [gguf_file] = (project / "data/export/gguf").glob("*-f32.gguf")
    reader = GGUFReader(gguf_file)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 513 and tokens[512] == "<|answer|>"
    table = {t.name: t for t in reader.tensors}
    assert "output.weight" not in table  # tied: llama.cpp reads the head from token_embd
    rows = torch.from_numpy(table["token_embd.weight"].data.copy()).reshape(513, 64)
    assert torch.equal(rows, embedding)


def _tiny_grown_model(tie: bool):
    """A random 1-layer Llama of 32 tokens grown to 34 (rows 32 and 33 new)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.modeling.vocabulary import grow_vocabulary

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tie))
    grow_vocabulary(model, 34)
    return model


def _train_a_few_steps(model) -> None:
    ids = torch.tensor([[1, 32, 5, 33, 7, 9]])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step(), optimizer.zero_grad()


def test_under_lora_only_the_added_rows_train_in_an_untied_embedding_and_head():
    from engine.modeling.adapter import apply_peft
    from finetune.config.model import PeftSection

    model = _tiny_grown_model(tie=False)
    before = [w.detach().clone() for w in (model.model.embed_tokens.weight, model.lm_head.weight)]
    peft_model = apply_peft(model, PeftSection(r=2))
    trainable = sorted(n for n, p in peft_model.named_parameters()
                       if p.requires_grad and "lora_" not in n)
    assert trainable == ["base_model.model.lm_head.token_adapter.trainable_tokens_delta.default",
                         "base_model.model.model.embed_tokens.token_adapter."
                         "trainable_tokens_delta.default"]
    _train_a_few_steps(peft_model)
    merged = peft_model.merge_and_unload()
    for after, start in zip((merged.model.embed_tokens.weight, merged.lm_head.weight), before):
        assert torch.equal(after[:32], start[:32])  # exactly: the old rows are frozen
        assert not torch.equal(after[32:], start[32:])


def test_trainable_token_indices_null_trains_the_embedding_layers_in_full():
    from engine.modeling.adapter import apply_peft
    from finetune.config.model import PeftSection

    model = _tiny_grown_model(tie=True)
    start = model.model.embed_tokens.weight.detach().clone()
    peft_model = apply_peft(model, PeftSection(r=2, trainable_token_indices=None))
    assert any("modules_to_save" in n for n, p in peft_model.named_parameters()
               if p.requires_grad)
    _train_a_few_steps(peft_model)
    merged = peft_model.merge_and_unload()
    assert not torch.equal(merged.model.embed_tokens.weight[:32], start[:32])  # in full
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still tied


def test_trainable_token_ids_the_model_lacks_are_refused_in_one_line():
    import pytest

    from engine.modeling.adapter import apply_peft
    from finetune.config.model import PeftSection
    from finetune.errors import PipelineError

    with pytest.raises(PipelineError, match=r"^peft.trainable_token_indices.embed_tokens: "
                       r"token id 40 is past the vocabulary \(34 rows\)$"):
        apply_peft(_tiny_grown_model(tie=True),
                   PeftSection(trainable_token_indices={"embed_tokens": [3, 40]}))
    with pytest.raises(PipelineError, match=r"^peft.trainable_token_indices.q_proj: not a "
                       r"layer of the model with one row per token \(those are: "
                       r"embed_tokens, lm_head\)$"):
        apply_peft(_tiny_grown_model(tie=True),
                   PeftSection(trainable_token_indices={"q_proj": [3]}))
    explicit = apply_peft(_tiny_grown_model(tie=True), PeftSection(trainable_token_indices=[3]))
    assert explicit.base_model.model.model.embed_tokens.token_adapter.token_indices == {"default": [3]}


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


def test_the_pipeline_refuses_token_rows_of_a_tied_embedding_split_across_its_stages():
    import pytest

    from engine.modeling.adapter import apply_peft
    from engine.modeling.pipeline_stages import cut_stages
    from finetune.config.model import PeftSection
    from finetune.errors import PipelineError

    with pytest.raises(PipelineError, match=r"^distributed.strategy pipeline: the model ties "
                       r"its input embedding to its output layer and "
                       r"peft.trainable_token_indices trains rows of both"):
        cut_stages(apply_peft(_tiny_grown_model(tie=True), PeftSection(r=2)), [0], 2)
