"""The chunked training loss (engine/objective/loss.py): the full loss's value and gradients, less
memory, and a model that transforms its logits refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from transformers import LlamaConfig, LlamaForCausalLM

from engine.datapath.data import IGNORE_INDEX
from engine.objective.loss import FullLoss, build_loss
from finetune.errors import PipelineError


def _tiny(vocab: int = 1000, hidden: int = 32):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False))


def _batch(vocab: int, rows: int = 3, tokens: int = 40):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    labels = ids.clone()
    labels[:, :11] = IGNORE_INDEX  # a prompt
    labels[1, 30:] = IGNORE_INDEX  # padding
    return ids, labels


def _loss_and_grads(model, loss, ids, labels):
    model.zero_grad()
    with loss.computing(labels):
        value = loss.loss_sum(model(input_ids=ids, use_cache=False), labels)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                            if p.requires_grad}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to summation order: 1e-5 of the tensor's largest entry."""
    return float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.parametrize("chunk", [7, 4096])  # many chunks (checkpointed), one chunk
def test_chunked_loss_equals_the_full_loss_and_its_gradients(chunk):
    model = _tiny()
    ids, labels = _batch(1000)
    full, full_grads = _loss_and_grads(model, FullLoss(), ids, labels)
    chunked, grads = _loss_and_grads(model, build_loss(model, chunk, torch.device("cpu")),
                                     ids, labels)
    assert abs(float(chunked) - float(full)) <= 1e-6 * abs(float(full))
    assert full_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert _close(grad, full_grads[name]), name
    # outside a computing() block the head gives ordinary logits (evaluation, generation)
    assert model(input_ids=ids).logits.shape == (3, 40, 1000)


def test_chunked_loss_with_no_target_is_zero_and_still_reaches_the_head():
    model = _tiny()
    ids, labels = _batch(1000)
    labels[:] = IGNORE_INDEX
    value, grads = _loss_and_grads(model, build_loss(model, 8, torch.device("cpu")), ids, labels)
    assert float(value) == 0.0
    assert torch.count_nonzero(grads["lm_head.weight"]) == 0  # present (DDP needs it), zero


def test_chunked_loss_goes_through_a_lora_output_layer():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny(), LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    for name, p in model.named_parameters():  # LoRA B starts at zero: make the path count
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ids, labels = _batch(1000)
    full, full_grads = _loss_and_grads(model, FullLoss(), ids, labels)
    chunked, grads = _loss_and_grads(model, build_loss(model, 16, torch.device("cpu")),
                                     ids, labels)
    assert abs(float(chunked) - float(full)) <= 1e-6 * abs(float(full))
    lora_head = [n for n in grads if "lm_head" in n and "lora" in n]
    assert lora_head and all(_close(grads[n], full_grads[n]) for n in lora_head)


def test_a_model_that_transforms_its_logits_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        final_logit_softcapping=2.0))
    with pytest.raises(PipelineError, match="training.loss_chunk_tokens: Gemma2ForCausalLM "
                       "changes its logits after the output layer"):
        build_loss(model, 64, torch.device("cpu"))


PEAK = """
import resource, sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from test_loss import _tiny, _batch
from engine.objective.loss import FullLoss, build_loss
torch.set_num_threads(1)
model = _tiny(vocab=32000, hidden=16)
ids, labels = _batch(32000, rows=2, tokens=2048)
chunk = {chunk}
loss = FullLoss() if chunk is None else build_loss(model, chunk, torch.device("cpu"))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with loss.computing(labels):
    value = loss.loss_sum(model(input_ids=ids, use_cache=False), labels)
value.backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_chunked_loss_lowers_peak_memory():
    """2 x 2048 tokens at a 32k vocabulary: the full fp32 logits are 0.5 GB, and the cross
    entropy's log-softmax and gradient as much again; 512-token chunks need an eighth of it."""
    def peak_mb(chunk):
        out = subprocess.run([sys.executable, "-c", PEAK.format(
            root=str(ROOT), tests=str(ROOT / "tests"), chunk=chunk)], capture_output=True,
            text=True, check=True)
        return int(out.stdout.split()[-1])

    full, chunked = peak_mb(None), peak_mb(512)
    # measured: full 1516 MB alone, 934 MB beside other tests; chunked 208 MB
    assert full > 500, full  # at least the fp32 logits (524 MB)
    assert chunked < full / 3, (chunked, full)


@pytest.mark.filterwarnings("error::UserWarning")  # the probe once warned on every run
def test_a_fused_loss_factory_is_probed_against_the_full_loss(tmp_path):
    """fused_loss_factory: the plain cross entropy of (hidden, weight, labels) gives the full
    loss and its gradients; a function returning the mean is refused with one line."""
    from engine.objective.fused import factory_loss

    (tmp_path / "fused.py").write_text(
        "import torch\n"
        "def ce(reduction='sum'):\n"
        "    return lambda h, w, y: torch.nn.functional.cross_entropy(\n"
        "        (h @ w.T).float(), y, reduction=reduction)\n"
        "def mean():\n"
        "    return ce('mean')\n"
        "def of_model(model):\n"
        "    return ce()\n")
    model, logged = _tiny(), []
    ids, labels = _batch(1000)
    full = FullLoss().loss_sum(model(input_ids=ids), labels)
    loss = factory_loss(model, f"{tmp_path}/fused.py:ce", torch.device("cpu"), None,
                        logged.append)
    with loss.computing(labels):
        fused = loss.loss_sum(model(input_ids=ids), labels)
    assert torch.allclose(fused, full, rtol=1e-5) and "fused loss from" in logged[0]
    with pytest.raises(PipelineError, match=r"training.fused_loss_factory: '.*fused.py:mean' "
                       r"does not compute the summed cross entropy \(probe loss"):
        factory_loss(_tiny(), f"{tmp_path}/fused.py:mean", torch.device("cpu"), None,
                     logged.append)
    # a factory of the model (Forgather's f(model)) is another contract: one line, no TypeError
    with pytest.raises(PipelineError, match=r"training.fused_loss_factory: '.*fused.py:of_model' "
                       r"takes arguments \(model\); it must be called with none"):
        factory_loss(_tiny(), f"{tmp_path}/fused.py:of_model", torch.device("cpu"), None,
                     logged.append)
