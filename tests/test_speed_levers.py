"""Speed and memory levers that must not change the math: pad_to_multiple_of, the SDPA backend
choice, the fused optimizer default on CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.data import collate, collate_packed, token_loss_sum
from engine.optim import fused_default
from engine.runtime import attention_backends
from finetune.config.schema import TrainingConfig
from finetune.errors import PipelineError
from test_loss import _tiny


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


def test_padding_free_with_pad_to_multiple_of_is_refused():
    with pytest.raises(ValueError, match="pad_to_multiple_of: padding_free rows are never"):
        TrainingConfig(padding_free=True, pad_to_multiple_of=8)


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
    with pytest.raises(PipelineError, match="training.sdpa_backend: cudnn_attention needs a "
                       "CUDA GPU; on cpu use flash_attention or math"):
        _sdpa_ops(TrainingConfig(sdpa_backend=["math", "cudnn_attention"]))


def test_the_optimizer_is_fused_on_cuda_unless_the_user_chose():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused_default(torch.optim.AdamW, cuda, {}) == {"fused": True}
    assert fused_default(torch.optim.AdamW, cuda, {"foreach": True}) == {}
    assert fused_default(torch.optim.AdamW, cpu, {}) == {}
    assert fused_default(torch.optim.LBFGS, cuda, {}) == {}  # it has no fused kernel


def test_the_gpu_benchmark_refuses_cleanly_without_a_gpu(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), "--tokenized",
                           str(tmp_path), "--tokenizer", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "bench/gpu.py: no CUDA device here; run it on a GPU machine (bench/suite.py is the "
        "CPU benchmark)"]
