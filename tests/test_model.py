"""Model and PEFT options: each `model.*` / `peft.*` key changes what is loaded or trained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import ROOT

from engine.modeling.adapter import apply_peft
from engine.modeling.model import load_base_model, model_class, register_model_class
from finetune.config.model import ModelConfig, PeftSection
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


def test_meta_construction_holds_no_weights_then_reads_the_same_model_and_adapter(tmp_path):
    """construct_model_on meta: the skeleton's parameters have no storage (a stride-0 view of
    one element each); once read from the checkpoint, weights, rotary tables, the adapter's
    seeded initialisation and the logits equal the default load's bit for bit."""
    from engine.modeling.construction import has_placeholders, materialise

    cfg, peft = ModelConfig(name_or_path=STORIES), PeftSection()
    torch.manual_seed(0)
    default = apply_peft(load_base_model(cfg, ROOT), peft)
    torch.manual_seed(0)
    skeleton = load_base_model(cfg, ROOT, construct="meta")
    params = list(skeleton.parameters())
    assert sum(p.numel() for p in params) > 250_000
    assert sum(p.untyped_storage().nbytes() for p in params) <= 4 * len(params)
    meta = apply_peft(skeleton, peft)
    read = materialise(meta, str(ROOT / STORIES), None, torch.device("cpu"))
    assert not has_placeholders(meta) and read["construct_tensors_read"] > 0
    want, got = default.state_dict(), meta.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)  # lora_A included: same draws
    assert any("lora_A" in k for k in want)
    ids = torch.tensor([[1, 5, 9, 13]])
    assert torch.equal(default(input_ids=ids).logits, meta(input_ids=ids).logits)
    # a folder without safetensors cannot be read piecewise: one line
    (tmp_path / "bin").mkdir()
    shutil.copy(ROOT / STORIES / "config.json", tmp_path / "bin")
    torch.save(load_base_model(cfg, ROOT).state_dict(), tmp_path / "bin/pytorch_model.bin")
    with pytest.raises(PipelineError, match="has no model.safetensors .* construct_model_on: "
                                            "default"):
        materialise(load_base_model(cfg, ROOT, construct="meta"), str(tmp_path / "bin"), None,
                    torch.device("cpu"))


def test_device_construction_loads_straight_onto_the_device():
    """construct_model_on device hands the device to from_pretrained (device_map): asked for
    the meta device, no weight is read into host memory; the default loads on the CPU."""
    cfg = ModelConfig(name_or_path=STORIES)
    on_device = load_base_model(cfg, ROOT, construct="device", device=torch.device("meta"))
    assert {p.device.type for p in on_device.parameters()} == {"meta"}
    default = load_base_model(cfg, ROOT, device=torch.device("meta"))
    assert {p.device.type for p in default.parameters()} == {"cpu"}
