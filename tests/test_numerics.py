"""Portable CPU numerics (training.cpu_numerics, finetune/numerics.py): the same bytes from the
same inputs whatever the CPU offers, and the lineage that says what a run used.

One machine cannot be two, so the other machine is emulated the way its kernels would differ:
an AVX2-only CPU (ATen's dispatch capped at AVX2, MKL's instructions capped at AVX2, oneDNN's
too) with one core (taskset). Native numerics train different bytes there when this machine
has AVX-512; portable numerics must train the same bytes on both.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from finetune import numerics
from tests.helpers import ROOT

# A few LoRA steps of the shipped 260K Llama; prints the ATen capability in effect and the
# sha256 of the trained adapter weights. Portable runs enter their plan as `finetune stage`
# does, before torch loads.
TRAIN = r"""
import hashlib, json, sys
from types import SimpleNamespace
mode = sys.argv[1]
if mode == "portable":
    from finetune import numerics
    cfg = SimpleNamespace(training=SimpleNamespace(cpu_numerics="portable", resolved_device="cpu"),
                          distributed=SimpleNamespace(threads_per_process=None, nproc_per_node=1))
    numerics.enter(numerics.plan(cfg))
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
if mode == "portable":
    torch.set_num_threads(numerics.plan(cfg).threads)
torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[2]),
                       LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                  init_lora_weights="gaussian"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
ids = torch.randint(0, model.config.vocab_size, (4, 96))
for _ in range(4):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
digest = hashlib.sha256()
for name, p in sorted(model.named_parameters()):
    if p.requires_grad:
        digest.update(p.detach().numpy().tobytes())
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "threads": torch.get_num_threads(), "sha256": digest.hexdigest()}))
"""

#: an AVX2-only machine's kernels, as far as the libraries let a process ask for them
AVX2_MACHINE = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                "ONEDNN_MAX_CPU_ISA": "AVX2"}
PINS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
        "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _train(mode: str, machine: dict[str, str], one_core: bool) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in PINS}
    env.update(machine, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", TRAIN, mode, str(ROOT / "data/models/stories260K")]
    if one_core:
        cmd = ["taskset", "-c", "0", *cmd]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(numerics.portable_blocker("cpu") is not None or not shutil.which("taskset"),
                    reason="portable numerics need an x86-64 CPU with AVX2 (and taskset)")
def test_portable_numerics_train_the_same_bytes_on_an_emulated_avx2_one_core_machine():
    runs = {("native", False): {}, ("native", True): AVX2_MACHINE,
            ("portable", False): {}, ("portable", True): AVX2_MACHINE}
    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(runs, pool.map(lambda k: _train(k[0], runs[k], one_core=k[1]), runs)))
    here, there = done[("portable", False)], done[("portable", True)]
    assert here["capability"] == there["capability"] == "AVX2"
    assert here["threads"] == there["threads"] == numerics.PORTABLE_THREADS
    assert here["sha256"] == there["sha256"]
    if "avx512f" in numerics.cpu()["flags"].split(","):
        # the emulation is a different machine for native numerics: the check above has teeth
        assert done[("native", False)]["capability"].startswith("AVX512")
        assert done[("native", False)]["sha256"] != done[("native", True)]["sha256"]
        assert done[("native", False)]["sha256"] != here["sha256"]


def _cfg(mode="portable", device="cpu", threads=None, nproc=1):
    return SimpleNamespace(training=SimpleNamespace(cpu_numerics=mode, resolved_device=device),
                           distributed=SimpleNamespace(threads_per_process=threads,
                                                       nproc_per_node=nproc))


def test_the_plan_pins_kernels_and_threads_only_where_portable_can_hold(monkeypatch):
    portable = numerics.plan(_cfg())
    if numerics.portable_blocker("cpu") is None:
        assert portable.mode == "portable" and portable.threads == numerics.PORTABLE_THREADS
        assert portable.env == {**numerics.PORTABLE_ENV, "OMP_NUM_THREADS": "2",
                                "MKL_NUM_THREADS": "2"}
    assert numerics.plan(_cfg(threads=3)).threads == 3
    gpu = numerics.plan(_cfg(device="cuda"))
    assert (gpu.mode, gpu.env) == ("native", {}) and "CUDA GPU" in gpu.why
    native = numerics.plan(_cfg("native", nproc=2))
    assert native.env == {} and native.why is None
    monkeypatch.setattr(numerics, "cpu", lambda: {"arch": "aarch64", "model": "m",
                                                  "vendor": "v", "flags": "asimd"})
    arm = numerics.plan(_cfg())
    assert arm.mode == "native" and arm.why == ("this CPU is aarch64, and portable numerics "
                                                "are x86-64's (AVX2)")
    assert numerics.settings(arm)["numerics.not_portable_because"] == arm.why


def _lineage(mode="portable", flags="avx2,fma,avx512f", threads="2", model="A"):
    pins = numerics.PORTABLE_ENV if mode == "portable" else {}
    return {"numerics.mode": mode, "numerics.threads": threads,
            **{f"numerics.{k}": pins.get(k, "") for k in numerics.PORTABLE_ENV},
            "numerics.cpu_arch": "x86_64", "numerics.cpu_model": model,
            "numerics.cpu_flags": flags, "numerics.cpu_vendor": "v"}


def test_bytes_are_expected_equal_only_under_the_same_numerics():
    assert numerics.comparable(_lineage(), _lineage(flags="avx2,fma", model="B")) is None
    assert numerics.comparable(_lineage("native"), _lineage("native")) is None
    assert numerics.comparable(_lineage("native"), _lineage("native", flags="avx2,fma")) == (
        "native numerics on another CPU (numerics.cpu_flags: recorded avx2,fma,avx512f, "
        "here avx2,fma)")
    assert numerics.comparable(_lineage(), _lineage("native")) == (
        "numerics.mode was portable, here it is native")
    assert numerics.comparable(_lineage(), _lineage(threads="4")) == (
        "numerics.threads was 2, here it is 4")
    assert numerics.comparable({}, _lineage()) == "numerics.mode was unset, here it is portable"


def test_reproduce_compares_within_tolerance_only_where_the_numerics_differ():
    from tasks.reproduce import Registered, numerics_differ

    def registered(lineage, cpu_numerics):
        return Registered("models:/m/1", "m", "1", "run", lineage,
                          {"training": {"cpu_numerics": cpu_numerics, "device": "cpu"},
                           "distributed": {"threads_per_process": None, "nproc_per_node": 1}},
                          {}, "eval.loss", None)

    here_native = numerics.settings(numerics.plan(_cfg("native")))
    assert numerics_differ(registered(here_native, "native")) is None
    elsewhere = {**here_native, "numerics.cpu_flags": "avx2,fma"}
    if here_native["numerics.cpu_flags"] != "avx2,fma":
        assert numerics_differ(registered(elsewhere, "native")).startswith(
            "native numerics on another CPU (numerics.cpu_flags: recorded avx2,fma, here ")
    if numerics.portable_blocker("cpu") is None:
        portable_elsewhere = {**numerics.settings(numerics.plan(_cfg())),
                              "numerics.cpu_flags": "avx2,fma", "numerics.cpu_model": "B"}
        assert numerics_differ(registered(portable_elsewhere, "portable")) is None
    # a version registered before numerics were recorded
    assert numerics_differ(registered({}, "native")) == (
        "numerics.mode was unset, here it is native")
