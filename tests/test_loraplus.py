"""LoRA+ (optimizer.loraplus_lr_ratio): each optimizer group's B matrices learn at ratio x its
A matrices' rate, through the regex groups, the schedule and FSDP2's parameter names; LoRA
matrices on an embedding at optimizer.loraplus_lr_embedding. In-process, on a random 1-layer
Llama."""

from __future__ import annotations

import pytest
import torch

from engine.modeling.adapter import apply_peft
from engine.objective.optim import build_optimizer, build_scheduler
from finetune.config.model import PeftSection
from finetune.config.optim import OptimizerConfig, SchedulerConfig


def lora_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    return apply_peft(base, PeftSection(r=2, target_modules=["q_proj", "v_proj",
                                                              "embed_tokens"]))


def rates(model, optimizer) -> dict[str, float]:
    """Each trainable parameter's learning rate, by its name with the wrappers' parts left out."""
    names = {id(p): n.replace("base_model.model.", "") for n, p in model.named_parameters()}
    return {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}


def test_b_matrices_learn_ratio_times_their_groups_a_rate_through_the_schedule():
    model = lora_model()
    cfg = OptimizerConfig(learning_rate=1e-3, weight_decay=0.1, loraplus_lr_ratio=16,
                          optimizer_groups={"v_proj": {"learning_rate": 2e-3}})
    optimizer = build_optimizer(model.named_parameters(), cfg, model=model)
    scheduler = build_scheduler(optimizer, SchedulerConfig(name="cosine", warmup_steps=2), 10)
    for factor in (0.5, 1.0):  # the schedule's warmup: every group's rate x 0.5, then x 1
        optimizer.step(), scheduler.step()
        lr = rates(model, optimizer)
        attn = "model.layers.0.self_attn"
        q_a = lr[f"{attn}.q_proj.lora_A.default.weight"]
        v_a = lr[f"{attn}.v_proj.lora_A.default.weight"]
        assert q_a == pytest.approx(factor * 1e-3)
        assert v_a == pytest.approx(factor * 2e-3)  # the regex group's own rate
        assert lr[f"{attn}.q_proj.lora_B.default.weight"] == pytest.approx(16 * q_a)
        assert lr[f"{attn}.v_proj.lora_B.default.weight"] == pytest.approx(16 * v_a)
        for side in "AB":  # peft's default rate for LoRA on an embedding
            assert lr[f"model.embed_tokens.lora_embedding_{side}.default"] == pytest.approx(
                factor * 1e-6)
    assert all(g["weight_decay"] == 0.1 for g in optimizer.param_groups)
    embedding = OptimizerConfig(loraplus_lr_ratio=4, loraplus_lr_embedding=1e-5)
    lr = rates(model, build_optimizer(model.named_parameters(), embedding, model=model))
    assert lr["model.embed_tokens.lora_embedding_B.default"] == 1e-5
    assert lr["model.layers.0.self_attn.q_proj.lora_B.default.weight"] == pytest.approx(4e-3)


def test_fsdp2_parameter_names_get_the_rates_a_single_process_gives():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = OptimizerConfig(loraplus_lr_ratio=16)
    model = lora_model()
    single = rates(model, build_optimizer(model.named_parameters(), cfg, model=model))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = build_optimizer(model.named_parameters(), cfg, model=model)
        assert all(type(p).__name__ == "DTensor" for g in optimizer.param_groups
                   for p in g["params"])
        assert rates(model, optimizer) == single
        assert sorted(set(single.values())) == [1e-6, 1e-3, pytest.approx(1.6e-2)]
    finally:
        dist.destroy_process_group()
