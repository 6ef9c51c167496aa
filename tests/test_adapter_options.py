"""peft's adapter options (DoRA, rsLoRA, PiSSA/OLoRA, layer/rank/alpha patterns,
modules_to_save, target_parameters): each trains, and what the run saves is checked through peft
itself: `PeftModel.from_pretrained(original base, saved adapter).merge_and_unload()` gives the
trained PEFT model's logits. Their refusals are compat rows (tests/test_compat.py runs one
example each); here the CLI's one line, the model-build check and the fingerprint."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from helpers import (
    ROOT,
    adapter,
    assert_weights_close,
    interrupt_then_resume,
    losses,
    resume_from_checkpoint_in_process,
    train_copy_here,
    train_here,
)

from engine.modeling.adapter import apply_peft, base_rewritten, save_adapter
from engine.modeling.model import load_base_model
from finetune.config.fingerprint import config_part
from finetune.config.loader import set_keys, validate_raw
from finetune.config.model import ModelConfig, PeftSection
from finetune.errors import PipelineError

STORIES = ModelConfig(name_or_path="data/models/stories260K")
BATCH = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """A 260K-parameter model gains nothing from more threads, and test files run side by
    side: one thread keeps these in-process steps from fighting them for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stories():
    """The original base, loaded once; each test adapts a copy."""
    return load_base_model(STORIES, ROOT)


def tiny_moe():
    """A Mixtral with random weights whose experts hold nn.Parameter weights
    (MixtralExperts.gate_up_proj / down_proj): what peft's target_parameters adapts."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2))


def trained(base, peft: PeftSection, steps: int = 3):
    """`base` (left untouched) with the adapter, after a few AdamW steps on BATCH."""
    torch.manual_seed(0)
    model = apply_peft(copy.deepcopy(base), peft, seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(input_ids=BATCH, labels=BATCH).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def assert_merged_equals_peft(base, model, folder) -> dict:
    """The run's save, loaded by peft onto the ORIGINAL base and merged, gives the PEFT
    model's logits (fp32, within 1e-5 and 1e-5 of their size: merging sums in another order),
    which the training moved; returns the saved config."""
    import json

    from peft import PeftModel

    save_adapter(model, folder)
    merged = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload()
    with torch.no_grad():
        want, got = model(input_ids=BATCH).logits, merged(input_ids=BATCH).logits
        before = base(input_ids=BATCH).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float((want - before).abs().max()) > 1e-3  # the adapter trained
    return json.loads((folder / "adapter_config.json").read_text())


KINDS = {
    "dora": dict(use_dora=True),
    "rslora": dict(use_rslora=True),
    "pissa": dict(init_lora_weights="pissa"),
    "pissa_niter": dict(init_lora_weights="pissa_niter_2"),
    "olora": dict(init_lora_weights="olora"),
    "rank_alpha_pattern": dict(rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 4.0}),
    "layers_to_transform": dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[1, 3],
                                layers_pattern="layers"),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_merged_by_peft_on_the_original_base_equals_the_trained_model(
        kind, stories, tmp_path):
    model = trained(stories, PeftSection(**KINDS[kind]))
    config = assert_merged_equals_peft(stories, model, tmp_path)
    rewrites = kind in ("pissa", "pissa_niter", "olora")
    # disabled, such an adapter leaves the residual: a reference model loads the base instead
    assert base_rewritten(model) == rewrites
    if rewrites:  # converted: [A | A0], [B | -B0]
        assert config["r"] == 16 and config["init_lora_weights"] is True
    if kind == "layers_to_transform":
        assert config["layers_to_transform"] == [1, 3]


def test_a_rewritten_base_gives_preference_methods_a_frozen_reference(stories):
    """DPO/KTO/GRPO compare with the base: under PiSSA the policy with its adapter disabled is
    the residual, so the reference is a frozen copy of the original base (plain LoRA: the
    policy itself, adapter disabled)."""
    from types import SimpleNamespace

    from engine.recipe.reference import Reference

    def reference(model):
        return Reference.of(SimpleNamespace(
            strategy=SimpleNamespace(module=model), cfg=SimpleNamespace(model=STORIES),
            paths=SimpleNamespace(project_root=ROOT), dist=SimpleNamespace(device="cpu"),
            log=lambda line: None))

    with torch.no_grad():
        want = stories(input_ids=BATCH).logits
    for kind, frozen in (("pissa", True), ("rslora", False)):
        ref = reference(trained(stories, PeftSection(**KINDS[kind]), steps=1))
        assert (ref.frozen is not None) == frozen
        with ref.model() as model, torch.no_grad():
            torch.testing.assert_close(model(input_ids=BATCH).logits, want)


def test_lora_on_moe_expert_parameters_trains_them_and_merges(tmp_path):
    """target_parameters on a MoE model built by model.model_init (through our loader and
    adapter code): the experts' LoRA weights move, and peft's merge gives the same logits."""
    cfg = ModelConfig(name_or_path="data/models/stories260K",
                      model_init="test_adapter_options:tiny_moe")
    base = load_base_model(cfg, ROOT)
    peft = PeftSection(target_modules=["q_proj"], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in
             apply_peft(copy.deepcopy(base), peft).named_parameters() if p.requires_grad}
    model = trained(base, peft)
    experts = [n for n in start if ".experts." in n and "lora_" in n]
    assert len(experts) == 2 * 2 * 2  # A and B, two parameters, two layers
    moved = dict(model.named_parameters())
    assert all(not torch.equal(start[n], moved[n]) for n in experts)
    assert_merged_equals_peft(base, model, tmp_path)
    with pytest.raises(PipelineError, match=r"^peft.target_parameters: 'mlp.experts.nope' is "
                                            r"not a parameter of MixtralForCausalLM$"):
        apply_peft(copy.deepcopy(base), PeftSection(target_parameters=["mlp.experts.nope"]))


def test_a_base_rewriting_init_refuses_a_grown_vocabulary(stories):
    """peft's conversion keeps lora_A and lora_B only: embeddings trained in full for new
    tokens would be lost from the saved adapter, so the run stops before it starts."""
    from engine.modeling.vocabulary import GREW

    grown = copy.deepcopy(stories)
    setattr(grown, GREW, True)
    with pytest.raises(PipelineError, match=r"^peft.init_lora_weights: olora cannot train a "
                                            r"grown vocabulary .* would be lost"):
        apply_peft(grown, PeftSection(init_lora_weights="olora"))


DEFAULT = yaml.safe_load((ROOT / "params/default.yaml").read_text())
NEW_KEYS = {"peft.use_dora": True, "peft.use_rslora": True, "peft.init_lora_weights": "olora",
            "peft.layers_to_transform": [1], "peft.rank_pattern": {"q_proj": 4},
            "peft.alpha_pattern": {"q_proj": 4.0}, "peft.modules_to_save": ["lm_head"],
            "peft.target_parameters": ["mlp.down_proj.weight"]}


def test_each_new_key_changes_the_checkpoint_fingerprint():
    def part(overrides):
        return config_part(validate_raw(set_keys(DEFAULT, overrides)))

    default = part({})
    lists = {"peft.target_modules": ["q_proj"]}  # what layers_to_transform picks among
    for key, value in {**NEW_KEYS, "peft.layers_pattern": "layers"}.items():
        changed = {key: value, **(lists if key.startswith("peft.layers") else {})}
        if key == "peft.layers_pattern":
            changed["peft.layers_to_transform"] = [1]
            assert part(changed) != part({**changed, key: None}), key
        else:
            assert part(changed) != part({k: v for k, v in changed.items() if k != key}), key
    assert part({"peft.init_lora_weights": "pissa_niter_2"}) != part(
        {"peft.init_lora_weights": "pissa_niter_4"}) != default


def test_validate_refuses_ia3_options_unknown_parameters_and_loftq_in_one_line(tmp_path, capsys, monkeypatch):
    from helpers import copy_project

    from flows.cli import main

    monkeypatch.chdir(copy_project(tmp_path / "p"))
    code = main(["validate", "-s", "peft.peft_type=IA3", "-s", "+peft.use_dora=true"])
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1, errors
    assert "peft.use_dora: true does not combine with peft.peft_type IA3" in errors[0]
    code = main(["validate", "-s", "+peft.target_parameters=[mlp.nope]"])
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and errors == [
        "error: peft.target_parameters: 'mlp.nope' is not a parameter of LlamaForCausalLM"]
    code = main(["validate", "-s", "+peft.init_lora_weights=loftq"])
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "peft.init_lora_weights: loftq: peft's LoftQ " \
        "quantizes with bitsandbytes on a CUDA GPU" in errors[0], errors


def test_pissa_niter_resumes_bitwise_from_its_checkpoint(tokenized, tmp_path):
    """The resumed run rebuilds the same residual base (the randomized SVD seeded from
    training.seed) under the checkpoint's adapter: it ends bitwise as the uninterrupted one."""
    out = resume_from_checkpoint_in_process(tokenized, tmp_path, {
        "peft.init_lora_weights": "pissa_niter_2", "training.max_steps": 4,
        "checkpoint.save_steps": 2, "eval.eval_steps": 2}, at=2)
    assert "resumed from" in out


@pytest.mark.distributed
def test_dora_rslora_under_fsdp2_on_two_processes_match_one_and_resume_bitwise(
        tokenized, tmp_path):
    """DoRA + rsLoRA: FSDP2 2 ranks x batch 4 equals one process x batch 8 (fp32), and the
    two-process run, SIGKILLed right after its first checkpoint, resumes bitwise."""
    params = {"peft.use_dora": True, "peft.use_rslora": True, "optimizer.name": "SGD",
              "optimizer.learning_rate": 0.05, "training.max_grad_norm": 1e9,
              "training.max_steps": 4, "checkpoint.save_steps": 2, "eval.eval_steps": 2}
    one, _ = train_here(tokenized, tmp_path / "one",
                        {**params, "training.per_device_train_batch_size": 8})
    assert any("lora_magnitude_vector" in k for k in adapter(one))
    sharded = {**params, "distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2}
    project, proc = train_copy_here(tokenized, tmp_path / "two", sharded)
    assert "strategy fsdp2, world size 2" in proc.stdout
    assert losses(project) == pytest.approx(losses(one), abs=1e-5)
    assert_weights_close(adapter(project), adapter(one))
    interrupt_then_resume(tokenized, tmp_path, sharded, full=project)


# An adapter section as each tool's docs write one with DoRA, rsLoRA and LoRA+ (Axolotl's
# config reference names; LLaMA-Factory's examples/extras/loraplus/llama3_lora_sft.yaml with
# its use_dora / use_rslora switches).
AXOLOTL = """
adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_target_linear: true
peft_use_dora: true
peft_use_rslora: true
loraplus_lr_ratio: 16
loraplus_lr_embedding: 1.0e-6
learning_rate: 0.0002
"""
LLAMA_FACTORY = """
finetuning_type: lora
lora_target: all
lora_rank: 8
lora_alpha: 16
use_dora: true
use_rslora: true
loraplus_lr_ratio: 16.0
learning_rate: 1.0e-4
"""


def rename_table() -> list[dict[str, str]]:
    """docs/training.md's table of renames, as rows {axolotl, llama_factory, here, value}."""
    text = (ROOT / "docs/training.md").read_text()
    body = text.split("| Axolotl | LLaMA-Factory | here | value |\n|---|---|---|---|\n", 1)[1]
    rows = []
    for line in body.splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows.append(dict(zip(("axolotl", "llama_factory", "here", "value"), cells)))
    return rows


def renamed(config: dict, tool: str) -> dict:
    """`config`'s keys renamed as the table says, values changed only where its value column
    says so; a key the table lacks fails the test."""
    table = {}
    for row in rename_table():
        key, _, literal = row[tool].partition(": ")
        if key:
            table[key] = (row["here"], literal, row["value"])
    out = {}
    for key, value in config.items():
        assert key in table, f"{tool}'s {key} is not in docs/training.md's rename table"
        here, literal, note = table[key]
        if literal:  # a row for one value of the key (`adapter: lora`)
            assert str(value).lower() == literal, (key, value)
            value = yaml.safe_load(note.strip("`"))
        elif "comma-separated" in note and isinstance(value, str):
            value = "all-linear" if value == "all" else [v.strip() for v in value.split(",")]
        out[here] = value
    return out


@pytest.mark.parametrize("tool, config", [("axolotl", AXOLOTL), ("llama_factory", LLAMA_FACTORY)])
def test_a_dora_rslora_loraplus_config_from_another_tool_validates_after_the_documented_renames(
        tool, config):
    values = renamed(yaml.safe_load(config), tool)
    raw = yaml.safe_load((ROOT / "params/default.yaml").read_text())
    cfg = validate_raw(set_keys(raw, values))
    assert cfg.peft.use_peft and cfg.peft.use_dora and cfg.peft.use_rslora
    assert cfg.peft.target_modules == "all-linear"
    assert cfg.optimizer.loraplus_lr_ratio == 16
    source = yaml.safe_load(config)
    assert cfg.peft.r == source.get("lora_r", source.get("lora_rank"))
    assert cfg.optimizer.learning_rate == source["learning_rate"]
