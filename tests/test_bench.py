"""bench/suite.py checks every input it will read before it starts any benchmark."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers import ROOT


def test_suite_names_a_missing_input_before_any_work(tmp_path):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "bench/suite.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FINETUNE_BENCH_DATA": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path}/data/alpaca_2k.json "
                                                   "not found, needed by the tokenize section")
    assert "Benchmark suite" not in proc.stdout and time.monotonic() - started < 60


def test_suite_needs_nothing_unshipped_without_alpaca_and_tokenize():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from suite import required_inputs
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert required_inputs(["throughput", "overheads", "strategies"], ["gsm8k"]) == {}
    assert {p.name for p in required_inputs(["tokenize"], ["gsm8k"])} == {
        "alpaca_2k.json", "tokenizer.json"}


def test_peers_benchmark_names_a_missing_input_before_any_work(tmp_path):
    results = ROOT / "bench/results/peers-cpu.json"
    before = results.stat().st_mtime_ns if results.exists() else None
    proc = subprocess.run([sys.executable, str(ROOT / "bench/peers_cpu.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FINETUNE_BENCH_DATA": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {tmp_path}/data/alpaca_2k.json not found, needed by bench/peers_cpu.py")
    assert proc.stdout == ""  # no work started
    assert (results.stat().st_mtime_ns if results.exists() else None) == before
