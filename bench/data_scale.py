"""Data stages at scale: rows/s and peak memory of our download, format and tokenize stages
against a plain `datasets` pipeline (load_dataset parquet -> map(format + tokenize) ->
save_to_disk) doing the same work with the same num_proc.

    python bench/data_scale.py --rows 100000 1000000 [--num-proc N]

Rows are Alpaca's (`alpaca_2k.json` from the benchmark data folder, repeated; generated
Alpaca-like rows when it is absent), completion type, the default stories260K tokenizer.
Each stage runs in its own fresh process, timed whole (start-up and imports included, as a
stage command costs; the pipeline alone is `work_s`); peak memory is reported twice: VmHWM (every
resident page, the memory-mapped Arrow files' pages included) and the peak of anonymous
memory (sampled every millisecond: what the process itself holds). Results go to
bench/results/data-scale-cpu.json, one entry per row count, merged with earlier runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workdir import ROOT, SHARED, copy_project, machine, set_params  # noqa: E402

RESULTS = ROOT / "bench/results/data-scale-cpu.json"
PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
COMPLETION = "{output}"
MAX_LEN = 512

#: run in a fresh process: `body` (which sets `rows`), timed, with its peak memory
MEASURED = """
import json, threading, time
peak = [0]
def anon():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("RssAnon:"))
def sample():
    while True:
        peak[0] = max(peak[0], anon()); time.sleep(0.001)
threading.Thread(target=sample, daemon=True).start()
{imports}
started = time.perf_counter()
{body}
seconds = time.perf_counter() - started
time.sleep(0.01)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"seconds": seconds, "vmhwm_mb": hwm / 1024, "peak_anon_mb": peak[0] / 1024}}))
"""

OURS = {
    "download": "from tasks.download import download as stage",
    "format": "from tasks.format import format_prompts as stage",
    "tokenize": "from tasks.tokenize import tokenize as stage",
}
OUR_BODY = """from finetune.workspace import Workspace
stage(Workspace.load("params/default.yaml"))"""

BASELINE_IMPORTS = """import datasets
from transformers import AutoTokenizer"""
BASELINE_BODY = """tok = AutoTokenizer.from_pretrained("data/models/stories260K")
PROMPT, COMPLETION, MAX_LEN = {prompt!r}, {completion!r}, {max_len}

def encode(batch):
    rows = [dict(zip(batch, v)) for v in zip(*batch.values())]
    prompts = tok([PROMPT.format(**r) for r in rows], add_special_tokens=False)["input_ids"]
    outs = tok([COMPLETION.format(**r) for r in rows], add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for p, c in zip(prompts, outs):
        seq = [tok.bos_token_id] + p + c + [tok.eos_token_id]
        ids.append(seq[:MAX_LEN])
        labels.append(([-100] * (len(p) + 1) + c + [tok.eos_token_id])[:MAX_LEN])
    return {{"input_ids": ids, "labels": labels}}

ds = datasets.load_dataset("parquet", data_files="data/source/rows.parquet", split="train",
                           cache_dir="hf-cache")
ds = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc={num_proc},
            load_from_cache_file=False)
ds.save_to_disk("baseline-tokenized")"""


def write_rows(path: Path, rows: int) -> str:
    """`rows` Alpaca rows (the 2k file repeated) as parquet, written a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = SHARED / "data/alpaca_2k.json"
    if source.exists():
        base = json.loads(source.read_text())
        origin = str(source.name)
    else:
        base = [{"instruction": f"Describe item {i} in one sentence.", "input": "" if i % 3
                 else f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box.",
                 "output": f"Item {i} is a small {['red', 'blue', 'green'][i % 3]} box "
                 f"that holds {i % 17} things."} for i in range(2000)]
        origin = "generated Alpaca-like rows"
    table = pa.Table.from_pylist(base)
    with pq.ParquetWriter(path, table.schema) as writer:
        left = rows
        while left > 0:
            part = table.slice(0, min(left, len(table)))
            writer.write_table(part, row_group_size=len(part))
            left -= len(part)
    return origin


def measure(project: Path, imports: str, body: str) -> dict:
    code = MEASURED.format(imports=imports, body=body)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"failed:\n{proc.stderr[-3000:]}")
    # `seconds`: the whole process (start, imports, tokenizer load), as a stage command
    # costs; `work_s`: the stage function or pipeline alone
    inner = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**inner, "work_s": inner["seconds"], "seconds": wall}


def run(rows: int, num_proc: int, keep: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"data-scale-{rows}-"))
    try:
        project = copy_project(tmp / "project")
        origin = write_rows(project / "data/source/rows.parquet", rows)
        set_params(project, {
            "data.data_files": None, "data.json_file_path": "data/source/rows.parquet",
            "data.test_split": None, "data.max_train_samples": None,
            "data.max_eval_samples": None, "data.prompt_template": PROMPT,
            "data.completion_template": COMPLETION, "data.max_seq_length": MAX_LEN,
            "data.num_proc": num_proc})
        out = {"rows": rows, "num_proc": num_proc, "source": origin, "stages": {}}
        for name, imports in OURS.items():
            m = measure(project, imports, OUR_BODY)
            out["stages"][name] = {**m, "rows_per_s": rows / m["seconds"]}
            print(rows, name, out["stages"][name], flush=True)
        ours_s = sum(s["seconds"] for s in out["stages"].values())
        out["ours"] = {"seconds": ours_s, "rows_per_s": rows / ours_s,
                       "peak_vmhwm_mb": max(s["vmhwm_mb"] for s in out["stages"].values()),
                       "peak_anon_mb": max(s["peak_anon_mb"] for s in out["stages"].values())}
        body = BASELINE_BODY.format(prompt=PROMPT, completion=COMPLETION, max_len=MAX_LEN,
                                    num_proc=num_proc if num_proc > 1 else None)
        m = measure(project, BASELINE_IMPORTS, body)
        out["baseline"] = {**m, "rows_per_s": rows / m["seconds"]}
        print(rows, "baseline", out["baseline"], flush=True)
        return out
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def table(results: dict) -> str:
    """The docs/benchmarks.md table of the recorded runs."""
    lines = ["| rows | stage | ours rows/s | ours peak MB (anon / all) | datasets rows/s | "
             "datasets peak MB (anon / all) |", "|---|---|---|---|---|---|"]
    for rows, run in sorted(results.get("runs", {}).items(), key=lambda kv: int(kv[0])):
        for name, m in run["stages"].items():
            lines.append(f"| {int(rows):,} | {name} | {m['rows_per_s']:,.0f} | "
                         f"{m['peak_anon_mb']:,.0f} / {m['vmhwm_mb']:,.0f} | | |")
        if "baseline" in run:
            b, o = run["baseline"], run["ours"]
            lines.append(f"| {int(rows):,} | **all three** | **{o['rows_per_s']:,.0f}** | "
                         f"{o['peak_anon_mb']:,.0f} / {o['peak_vmhwm_mb']:,.0f} | "
                         f"**{b['rows_per_s']:,.0f}** | "
                         f"{b['peak_anon_mb']:,.0f} / {b['vmhwm_mb']:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000])
    parser.add_argument("--num-proc", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--keep", action="store_true", help="keep the temp projects")
    parser.add_argument("--table", action="store_true",
                        help="print the recorded results as a markdown table, run nothing")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.table:
        print(table(results))
        return
    results["machine"] = machine()
    for rows in args.rows:
        results.setdefault("runs", {})[str(rows)] = run(rows, args.num_proc, args.keep)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
