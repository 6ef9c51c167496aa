"""Model and PEFT options: each `model.*` / `peft.*` key changes what is loaded or trained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import ROOT
from engine.model import apply_peft, load_base_model, model_class, register_model_class
from finetune.config.schema import ModelConfig, PeftSection
from finetune.errors import PipelineError

STORIES = "data/models/stories260K"


def load(**kwargs):
    return load_base_model(ModelConfig(name_or_path=STORIES, **kwargs), ROOT)


def test_model_class_registry_and_import_paths():
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    class Tagged(LlamaForCausalLM):
        pass

    register_model_class("tagged-llama", Tagged)
    assert model_class("tagged-llama") is Tagged
    assert type(load(auto_class_name="tagged-llama")) is Tagged
    assert model_class("AutoModelForCausalLM") is AutoModelForCausalLM
    assert model_class("transformers:LlamaForCausalLM") is LlamaForCausalLM
    with pytest.raises(PipelineError, match="'nope': not a transformers AutoModel class, a "
                                            "registered key \\(registered: .*tagged-llama"):
        model_class("nope")
    with pytest.raises(PipelineError, match="cannot import 'json:Nope'"):
        model_class("json:Nope")
    with pytest.raises(ValueError):
        ModelConfig(auto_class_name="not a name!")


def test_load_options_reach_from_pretrained():
    plain = load()
    assert plain.dtype == torch.float32 and plain.config._attn_implementation == "sdpa"
    assert plain.config.use_cache is False  # training default: no KV cache
    tuned = load(dtype="bfloat16", attn_implementation="eager", use_cache=True,
                 device_map="cpu")
    assert tuned.dtype == torch.bfloat16
    assert tuned.config._attn_implementation == "eager"
    assert tuned.config.use_cache is True
    with pytest.raises(PipelineError, match="device_map"):  # passed on, and checked, by HF
        load(device_map="nowhere")


def test_trust_remote_code_gates_model_code_shipped_with_the_weights(tmp_path):
    folder = tmp_path / "custom"
    shutil.copytree(ROOT / STORIES, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomLlama"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\n"
        "class CustomLlama(LlamaForCausalLM):\n    pass\n")
    # without trust, transformers ignores the shipped code and uses its own Llama class
    assert type(load_base_model(ModelConfig(name_or_path=str(folder)), ROOT)).__name__ == \
        "LlamaForCausalLM"
    model = load_base_model(ModelConfig(name_or_path=str(folder), trust_remote_code=True), ROOT)
    assert type(model).__name__ == "CustomLlama"


def names_with(model, part: str) -> set[str]:
    return {n for n, _ in model.named_parameters() if part in n}


def test_lora_options_shape_the_adapter():
    model = apply_peft(load(), PeftSection(r=4, lora_alpha=8, lora_dropout=0.1,
                                           target_modules=["q_proj"]))
    lora_a = dict(model.named_parameters())
    a = next(v for n, v in lora_a.items() if "lora_A" in n)
    assert a.shape[0] == 4  # r
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == 2.0  # alpha / r
    assert q.lora_dropout["default"].p == 0.1
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names_with(model, "lora_A")}
    assert adapted == {"q_proj"}  # target_modules list
    every = apply_peft(load(), PeftSection(target_modules="all-linear"))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names_with(every, "lora_A")}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} == adapted
    assert type(every).__name__ == "PeftModelForCausalLM"  # task_type CAUSAL_LM


def test_ia3_and_full_fine_tuning():
    ia3 = apply_peft(load(), PeftSection(peft_type="IA3", target_modules=["k_proj", "down_proj"],
                                         feedforward_modules=["down_proj"]))
    trainable = {n for n, p in ia3.named_parameters() if p.requires_grad}
    assert trainable and all("ia3_l" in n for n in trainable)
    full = apply_peft(load(), PeftSection(use_peft=False))
    assert all(p.requires_grad for p in full.parameters())


@pytest.mark.parametrize("bias, expected", [("none", set()), ("lora_only", {"c_attn"}),
                                            ("all", {"c_attn", "c_proj", "c_fc", "ln_1", "ln_2",
                                                     "ln_f"})])
def test_lora_bias_option(bias, expected):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                      n_positions=32))  # GPT-2 has biases; Llama has none
    model = apply_peft(gpt2, PeftSection(r=2, target_modules=["c_attn"], bias=bias))
    trained_biases = {n.replace(".base_layer", "").split(".bias")[0].rsplit(".", 1)[-1]
                      for n, p in model.named_parameters()
                      if p.requires_grad and n.endswith("bias")}
    assert trained_biases == expected
