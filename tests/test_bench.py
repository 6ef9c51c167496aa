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


def _bench_module(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_our_order_reads_hf_group_by_length_batches_after_the_layout(tmp_path):
    """The GPU and CPU peer benchmarks' fairness rests on this: after read_in_our_order, our
    engine's seeded batches over the new split are HF's group_by_length batches, in HF's order,
    and the returned order makes a sequential reader see the same rows."""
    import datasets

    same = _bench_module("same_batches")
    lengths = [(7 * i) % 53 + 3 for i in range(96)]
    datasets.Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]}) \
        .save_to_disk(str(tmp_path / "train"))
    batch, steps = 4, 5
    batches = same.hf_grouped_batches(lengths, batch, 42)[:steps]
    assert all(len(b) == batch for b in batches) and len({i for b in batches for i in b}) == 20
    order = same.read_in_our_order(tmp_path / "train", [i for b in batches for i in b], batch,
                                   steps, 42)
    laid = datasets.load_from_disk(str(tmp_path / "train"))["input_ids"]
    from engine.datapath.data import ShardedBatches

    ours = ShardedBatches(len(laid), batch, 0, 1, 42).epoch(0).tolist()
    assert [[laid[i][0] for i in b] for b in ours] == batches
    assert [laid[i][0] for i in order] == [i for b in batches for i in b]


def test_gpu_record_merges_starts_into_ranges_and_folds_dpo_rows():
    gpu = _bench_module("gpu")

    def row(tps, loss):
        return {"windows": [tps], "tokens_per_s": tps, "final_loss": loss, "mfu": 0.1,
                "peak_gib": 1.0, "padding_fraction": 0.0, "note": ""}

    first = gpu.merge_starts(None, {"device": "X", "results": {
        "HF Trainer group_by_length": row(100.0, 2.0), "ours padding_free": row(150.0, 2.0)}})
    second = gpu.merge_starts(first, {"device": "X", "results": {
        "HF Trainer group_by_length": row(200.0, 2.0), "ours padding_free": row(260.0, 2.02),
        "TRL SFTTrainer padding_free": {"error": "skipped: --budget spent"}}})
    assert second["starts"] == 2
    assert [s["tokens_per_s"] for s in second["results"]["ours padding_free"]["per_start"]] == [
        150.0, 260.0]
    assert gpu.best_peer(second["results"], 2) == ("HF Trainer group_by_length", 200.0)
    gpu.add_rows(second["results"], {"ours DPO": {**row(50.0, 0.6), "pairs_per_s": 5.0},
                                     "TRL DPOTrainer": {**row(40.0, 0.6), "pairs_per_s": 4.0}}, 2)
    table = gpu.table(second)
    assert "| ours padding_free | 150 to 260 | 1.30x to 1.50x |" in table
    assert "| +0.00% to +1.00% |" in table and "| TRL SFTTrainer padding_free | skipped |" in table
    assert "| ours DPO | 5.0 | 50 | 1.25x |" in table
    try:
        gpu.merge_starts({"device": "Y", "starts": 1, "results": {}}, second)
    except SystemExit as exc:
        assert "is not this device" in str(exc)
    else:
        raise AssertionError("a record of another device was merged")


def test_trace_summary_counts_each_step_once_and_splits_host_from_gpu_time():
    """bench/trace_summary.py on a two-step synthetic trace: the profiler's GPU twin of each
    step mark is not a third step, overlapping kernels are busy once, a kernel launched under
    Optimizer.step is the optimizer's whatever its name, and a gap over 5 us is idle time."""
    summary = _bench_module("trace_summary")

    def x(cat, name, ts, dur, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {} if corr is None else {"correlation": corr}}

    events = [x("user_annotation", "ProfilerStep#1", 0, 100),
              x("user_annotation", "ProfilerStep#2", 100, 100),
              x("gpu_user_annotation", "ProfilerStep#1", 5, 90),
              x("user_annotation", "Optimizer.step#AdamW.step", 150, 20),
              x("cuda_runtime", "cudaLaunchKernel", 1, 1, 1),
              x("cuda_runtime", "cudaLaunchKernel", 2, 1, 2),
              x("cuda_runtime", "cudaLaunchKernel", 160, 1, 3),
              x("cuda_runtime", "cudaStreamSynchronize", 180, 8),
              x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 181, 1),
              x("kernel", "sm90_xmma_gemm_bf16", 10, 20, 1),
              x("kernel", "pytorch_flash::flash_fwd_kernel", 25, 10, 2),
              x("kernel", "triton_poi_fused_add", 170, 10, 3)]
    s = summary.summarise(events)
    assert s["steps"] == 2 and s["host_wall_ms"] == 0.1  # 200 us over two steps
    assert s["gpu_busy_ms"] == 0.0175  # 10-35 and 170-180: 35 us over two steps
    assert s["kernels"] == 1.5 and s["launch_calls"] == 1.5 and s["host_syncs"] == 0.5
    assert s["dtoh_copies"] == 0.5 and s["gaps_over_5us"] == 0.5 and s["gap_ms"] == 0.0675
    assert s["family_ms"] == {"GEMM": 0.01, "attention": 0.005, "optimizer": 0.005}
    table = summary.table({"a": s})
    assert "| GPU busy / host wall | 18% |" in table and "| kernel time: GEMM (ms) | 0.01 |" in table


def test_fused_lora_bench_times_both_variants_and_refuses_a_missing_gpu():
    """bench/fused_lora.py measures peft and the fused layers on the same block in one run (a
    tiny round here: the numbers are the bench's, not the test's); --device cuda on a machine
    without one is one line and exit 2 before any work."""
    from types import SimpleNamespace

    import torch

    bench = _bench_module("fused_lora")
    got = bench.measure(SimpleNamespace(shape="smollm2-135M", tokens=8, rank=4, dtype="fp32",
                                        device="cpu", repeats=1))
    assert got["peft_ms"] > 0 and got["fused_ms"] > 0
    assert got["speedup"] == got["peft_ms"] / got["fused_ms"]
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(ROOT / "bench/fused_lora.py"), "--device",
                           "cuda"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: --device cuda: no CUDA GPU is visible here"


def test_peers_benchmark_has_our_row_at_every_peer_setting_and_divides_like_for_like():
    """Every peer setting (precision, base dtype) has our row at the same setting (else the
    headline ratio would fail after a half-hour run), a bf16 base is a LoRA setting on both
    sides, and the table divides each row by ours at its own setting."""
    peers = _bench_module("peers_cpu")
    for name, peer in peers.PEERS.items():
        assert peers.setting(peer) in peers.OURS_AT, name
        assert peer.lora_only or not peers.setting(peer)[1], name
    at = {setting: label for setting, (label, _) in peers.OURS_AT.items()}
    rates = {at[("fp32", False)]: 300.0, at[("bf16", False)]: 600.0, at[("bf16", True)]: 800.0,
             "HF fp32": 150.0, "HF bf16 base": 400.0}
    settings = {at[("fp32", False)]: ("fp32", False), at[("bf16", False)]: ("bf16", False),
                at[("bf16", True)]: ("bf16", True), "HF fp32": ("fp32", False),
                "HF bf16 base": ("bf16", True)}

    def result(rate):
        return {"window_tokens_per_s": rate, "tokens_per_s": rate, "padding_fraction": 0.0,
                "final_loss": 1.0, "held_out_loss": 1.0, "peak_rss_mb": 1.0}

    row = {"model": "m", "adapter": "LoRA", "best_peer": "HF bf16 base",
           "peers": {p: result(rates[p]) for p in ("HF fp32", "HF bf16 base")},
           "ours": {o: result(rates[o]) for o in at.values()},
           "precision": {k: v[0] for k, v in settings.items()}, "setting": settings}
    lines = peers.table([row]).splitlines()[2:]
    ratio = {line.split(" | ")[2]: float(line.split(" | ")[5]) for line in lines}
    assert ratio["HF fp32"] == 2.0 and ratio["HF bf16 base (best peer)"] == 2.0
    assert ratio[at[("bf16", False)]] == 1.0
