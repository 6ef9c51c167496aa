"""Speed and memory levers that must not change the math: pad_to_multiple_of, the SDPA backend
choice, the fused optimizer default on CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from test_loss import _tiny

from engine.datapath.data import collate, collate_packed, token_loss_sum
from engine.modeling.runtime import attention_backends
from engine.objective.optim import fused_default
from finetune.config.training import TrainingConfig
from finetune.errors import PipelineError


def _rows(lengths):
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(3, 1000, (n,), generator=g).tolist(),
             "labels": torch.randint(3, 1000, (n,), generator=g).tolist()} for n in lengths]


def test_pad_to_multiple_of_rounds_every_width_and_keeps_the_loss():
    rows = _rows([5, 19, 11])
    assert collate(rows, 0)["input_ids"].shape == (3, 19)
    padded = collate(rows, 0, multiple=16)
    assert padded["input_ids"].shape == (3, 32)
    assert collate_packed(rows, 0, capacity=32, multiple=32)["input_ids"].shape[1] == 32
    model = _tiny().eval()

    def loss(batch):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
        return float(token_loss_sum(logits, batch["labels"]))

    assert loss(padded) == pytest.approx(loss(collate(rows, 0)), rel=1e-5)


def test_padding_free_row_padded_to_a_bucket_keeps_the_loss():
    """pad_to_multiple_of with padding_free: the flat row's pad tail (a sequence of its own)
    changes no real token's logits, so the loss is the unbucketed row's."""
    from engine.datapath.data import collate_flat, model_inputs
    from engine.datapath.packing import enable_varlen

    rows = _rows([5, 19, 11])
    model = _tiny().eval()
    enable_varlen(model, "sdpa_per_example", torch.device("cpu"))
    bucketed, plain = collate_flat(rows, 0, multiple=16), collate_flat(rows, 0)
    assert bucketed["input_ids"].shape == (1, 48) and plain["input_ids"].shape == (1, 35)

    def loss(batch):
        with torch.no_grad():
            return float(token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"]))

    assert loss(bucketed) == pytest.approx(loss(plain), rel=1e-5)
    TrainingConfig(padding_free=True, pad_to_multiple_of=8)  # accepted: it buckets the row


def _sdpa_ops(training: TrainingConfig) -> set[str]:
    q = torch.randn(1, 2, 16, 8)
    with attention_backends(training, torch.device("cpu")):
        with torch.profiler.profile() as prof:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


def test_sdpa_backend_decides_the_kernel_and_cpu_refuses_cuda_only_ones():
    default = _sdpa_ops(TrainingConfig())
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in default
    math = _sdpa_ops(TrainingConfig(sdpa_backend=["math"]))
    assert "aten::_scaled_dot_product_attention_math" in math
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in math
    from finetune.config.compat import check_machine
    from finetune.config.schema import FinetuneConfig

    cfg = FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"}, "training": {
        "sdpa_backend": ["math", "cudnn_attention"]}})
    with pytest.raises(PipelineError, match=r'training.sdpa_backend: \["math", "cudnn_attention"\] '
                       "needs a CUDA GPU \\(only flash_attention and math run on a CPU\\)"):
        check_machine(cfg, torch.device("cpu"))
    check_machine(cfg, torch.device("cuda"))  # accepted where it means something


def test_the_optimizer_is_fused_on_cuda_unless_the_user_chose():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused_default(torch.optim.AdamW, cuda, {}) == {"fused": True}
    assert fused_default(torch.optim.AdamW, cuda, {"foreach": True}) == {}
    assert fused_default(torch.optim.AdamW, cpu, {}) == {}
    assert fused_default(torch.optim.LBFGS, cuda, {}) == {}  # it has no fused kernel


def test_the_gpu_benchmark_refuses_cleanly_without_a_gpu(tmp_path):
    import subprocess
    import sys

    from helpers import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), "--data",
                           str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "bench/gpu.py: no CUDA device here; run it on a GPU machine (bench/suite.py is the "
        "CPU benchmark; --smoke checks this script)"]


def test_compile_and_dtype_knobs_reach_torch_and_compile_ones_need_compile():
    import torch._dynamo.config as dynamo
    import torch._functorch.config as functorch

    from engine.modeling.runtime import configure_torch

    saved = (torch.get_default_dtype(), dynamo.recompile_limit,
             functorch.activation_memory_budget, torch.get_float32_matmul_precision())
    try:
        configure_torch(TrainingConfig(torch_compile=True, dynamo_recompile_limit=3,
                                       activation_memory_budget=0.5, default_dtype="bfloat16"))
        assert dynamo.recompile_limit == 3 and functorch.activation_memory_budget == 0.5
        assert torch.get_default_dtype() == torch.bfloat16
    finally:
        torch.set_default_dtype(saved[0])
        dynamo.recompile_limit, functorch.activation_memory_budget = saved[1], saved[2]
        torch.set_float32_matmul_precision(saved[3])
    for key, value in (("dynamo_recompile_limit", 3), ("activation_memory_budget", 0.5)):
        with pytest.raises(ValueError, match=f"{key}: .* needs torch_compile: true"):
            TrainingConfig(**{key: value})
    with pytest.raises(ValueError, match="speed_metrics_start_step 4 leaves no step"):
        TrainingConfig(max_steps=4, speed_metrics_start_step=4)


def test_ddp_skips_unused_parameter_reductions_when_asked(tmp_path):
    """A one-process gloo group is enough to build DDP and see the flag reach it."""
    import torch.distributed as dist

    from engine.process.comm import CommMeter
    from engine.process.distributed import Dist
    from engine.strategies.base import StrategySetup
    from engine.strategies.ddp import DDPStrategy
    from finetune.config.schema import FinetuneConfig

    data = {"json_file_path": "x.jsonl"}
    with pytest.raises(ValueError, match="needs find_unused_parameters: true"):
        FinetuneConfig.model_validate({"data": data, "distributed": {
            "skip_all_reduce_unused_params": True}})
    cfg = FinetuneConfig.model_validate({"data": data, "distributed": {
        "strategy": "ddp", "find_unused_parameters": True,
        "skip_all_reduce_unused_params": True}})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        d = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1,
                 device=torch.device("cpu"))
        model = DDPStrategy(StrategySetup.of(cfg), d, CommMeter()).wrap(torch.nn.Linear(2, 2))
        assert model.skip_all_reduce_unused_params and model.find_unused_parameters
    finally:
        dist.destroy_process_group()


def test_fsdp2_root_only_wrapping_makes_one_unit(tmp_path):
    import torch.distributed as dist
    from helpers import ROOT
    from torch.distributed.fsdp import FSDPModule

    from engine.modeling.model import load_base_model
    from engine.process.comm import CommMeter
    from engine.process.distributed import Dist
    from engine.strategies.base import StrategySetup
    from engine.strategies.fsdp2 import FSDP2Strategy
    from finetune.config.schema import FinetuneConfig

    def units(fsdp: dict) -> int:
        cfg = FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"}, "distributed": {
            "strategy": "fsdp2", "fsdp": fsdp}})
        model = load_base_model(cfg.model, ROOT)
        d = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1,
                 device=torch.device("cpu"))
        wrapped = FSDP2Strategy(StrategySetup.of(cfg), d, CommMeter()).wrap(model)
        return sum(isinstance(m, FSDPModule) for m in wrapped.modules())

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        assert units({}) == 6  # stories260K: 5 decoder blocks + the root
        assert units({"shard_transformer_layers": False}) == 1
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="needs shard_transformer_layers: true"):
        FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"}, "distributed": {
            "strategy": "fsdp2", "fsdp": {"shard_transformer_layers": False,
                                          "shard_modules": ["model.layers"]}}})


def test_cuda_only_memory_options_refuse_a_cpu_and_reach_cuda(monkeypatch):
    from engine.modeling.runtime import activation_offloading, apply_allocator_settings
    from finetune.config.compat import check_machine
    from finetune.config.schema import FinetuneConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for key, value in (("enable_activation_offloading", True), ("gc_threshold", 0.6)):
        cfg = FinetuneConfig.model_validate({"data": {"json_file_path": "x.jsonl"},
                                             "training": {key: value}})
        with pytest.raises(PipelineError, match=f"training.{key}: .* needs a CUDA GPU"):
            check_machine(cfg, cpu)
        check_machine(cfg, cuda)  # accepted where it means something
    offload = activation_offloading(TrainingConfig(enable_activation_offloading=True), cuda)
    assert isinstance(offload, torch.autograd.graph.save_on_cpu)
    assert not isinstance(activation_offloading(TrainingConfig(), cuda),
                          torch.autograd.graph.save_on_cpu)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,"
                       "garbage_collection_threshold:0.9")
    apply_allocator_settings(TrainingConfig(gc_threshold=0.6))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (
        "expandable_segments:True,garbage_collection_threshold:0.6")


def test_training_device_forces_the_cpu_and_refuses_a_missing_gpu(monkeypatch):
    from engine.process.distributed import choose_device

    assert TrainingConfig(use_cpu=True).resolved_device == "cpu"
    with pytest.raises(ValueError, match="use_cpu: true does not combine with device: cuda"):
        TrainingConfig(use_cpu=True, device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(PipelineError, match="training.device cuda: no CUDA GPU is visible"):
            choose_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine's answer
    assert choose_device("auto", local_rank=1) == torch.device("cuda:1")
    assert choose_device("cpu", local_rank=1) == torch.device("cpu")
