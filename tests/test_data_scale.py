"""The data stages at scale: memory that does not grow with the rows, bytes that do not depend
on data.num_proc, row numbers that stay the split's own across batches.

A generated parquet file of short completion rows (the shipped stories260K tokenizer) goes
through download, format and tokenize in a fresh process twice, at N and 4N rows; the peak
difference over the 3N extra rows is the per-row growth, of the peak of anonymous memory and
of VmHWM (every resident page, file-backed ones too: a stage reading its output memory-mapped,
as save_to_disk does, fails it). The stages keep nothing per row but download's split mask (1
byte, only with split_ratio), so a stage holding the split as a pandas frame or Python lists
(the old tokenize: about 9 KB a row) fails the bound by far.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.errors import PipelineError

from helpers import ROOT, copy_project, stages_here, write_params

SMALL = 12_000
LARGE = 4 * SMALL
#: allowed peak growth per extra row: measured ~100; the old stages grew ~9000 bytes a row
MAX_BYTES_PER_ROW = 200
#: a row with an empty answer: dropped by format, in its second batch
EMPTY_ROW = 10_000 + 345

#: the stages in a fresh process, printing their peak anonymous memory (KiB), sampled every
#: millisecond, and their VmHWM (KiB)
RUN_STAGES = """
import threading, time
from finetune.workspace import Workspace
from tasks.download import download
from tasks.format import format_prompts
from tasks.tokenize import tokenize
peak = [0]
def sample():
    while True:
        with open("/proc/self/status") as fh:
            anon = next(int(l.split()[1]) for l in fh if l.startswith("RssAnon:"))
        peak[0] = max(peak[0], anon)
        time.sleep(0.001)
threading.Thread(target=sample, daemon=True).start()
ws = Workspace.load("params/default.yaml")
download(ws); format_prompts(ws); tokenize(ws)
time.sleep(0.01)
with open("/proc/self/status") as fh:
    hwm = next(int(l.split()[1]) for l in fh if l.startswith("VmHWM:"))
print(peak[0], hwm)
"""


def write_rows(path: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # a few hundred distinct words: the tokenizer's word cache is full early at any size
    answers = [f"It is {i % 97 + i % 7}.\n#### {i % 97 + i % 7}" for i in range(n)]
    answers[EMPTY_ROW] = "  "
    questions = [f"Row {i % 89}: what is {i % 97} plus {i % 7}?" for i in range(n)]
    pq.write_table(pa.table({"question": questions, "answer": answers}), path,
                   row_group_size=5_000)


def params_for(project: Path, rows: int, num_proc: int) -> None:
    write_rows(project / "data/source/scale.parquet", rows)
    write_params(project, {"data.data_files": None,
                           "data.json_file_path": "data/source/scale.parquet",
                           "data.test_split": None, "data.max_seq_length": 64,
                           "data.max_train_samples": None, "data.max_eval_samples": None,
                           "data.num_proc": num_proc})


def peak_rss_kib(project: Path) -> tuple[int, int]:
    """(peak anonymous KiB, VmHWM KiB: every resident page, file-backed ones too)."""
    # Arrow's default pool (mimalloc) keeps freed memory for a while, more or less of it from
    # run to run (+-5 MB, 140 bytes a row here); the system allocator measures what is held
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ARROW_DEFAULT_MEMORY_POOL": "system"}
    proc = subprocess.run([sys.executable, "-c", RUN_STAGES], cwd=project, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    anon, hwm = proc.stdout.split()[-2:]
    return int(anon), int(hwm)


def outputs(project: Path) -> dict[str, bytes]:
    return {str(f.relative_to(project)): f.read_bytes()
            for folder in ("data/formatted", "data/tokenized")
            for f in sorted((project / folder).rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """The stages at SMALL and LARGE rows in fresh processes: (peak KiB at each, the SMALL
    run's outputs, the project)."""
    project = copy_project(tmp_path_factory.mktemp("scale"))
    params_for(project, SMALL, 1)
    small = peak_rss_kib(project)
    small_outputs = outputs(project)
    params_for(project, LARGE, 1)
    large = peak_rss_kib(project)
    return small, large, small_outputs, project


def test_peak_memory_does_not_grow_with_rows(scaled):
    (small, small_hwm), (large, large_hwm), _, project = scaled
    per_row = (large - small) * 1024 / (LARGE - SMALL)
    hwm_per_row = (large_hwm - small_hwm) * 1024 / (LARGE - SMALL)
    print(f"peak anonymous RSS {small} KiB at {SMALL} rows, {large} KiB at {LARGE}: "
          f"{per_row:.0f} B/row; VmHWM {small_hwm} / {large_hwm} KiB: {hwm_per_row:.0f} B/row")
    assert per_row < MAX_BYTES_PER_ROW, (small, large, per_row)
    # every resident page too: the saved split is streamed, not read memory-mapped
    # (save_to_disk's reads of the mapped file: ~775 B/row here)
    assert hwm_per_row < MAX_BYTES_PER_ROW, (small_hwm, large_hwm, hwm_per_row)
    stats = json.loads((project / "data/metrics/tokenize.json").read_text())
    assert stats["train"]["rows"] == LARGE - 1  # every row but the empty one, in order


def test_outputs_are_the_same_bytes_for_any_num_proc(scaled):
    _, _, single, project = scaled
    params_for(project, SMALL, 2)
    stages_here(project, "download", "format", "tokenize")
    assert outputs(project) == single
    fmt = json.loads((project / "data/metrics/format.json").read_text())
    assert fmt["train"] == {"rows": SMALL - 1, "dropped_rows": 1}


def test_a_dropped_row_is_named_by_its_row_in_the_split(scaled):
    *_, project = scaled
    params_for(project, SMALL, 1)
    write_params(project, {"data.max_dropped_fraction": 0.0})
    with pytest.raises(PipelineError, match=f"first: row {EMPTY_ROW}\\)"):
        stages_here(project, "download", "format")


def test_split_ratio_keeps_the_rows_pandas_sample_keeps():
    import numpy as np
    import pandas as pd

    from tasks.download import kept_rows

    frame = pd.DataFrame({"i": range(1003)})
    kept = frame.sample(frac=0.9, random_state=7).sort_index().index.to_numpy()
    assert np.array_equal(np.flatnonzero(kept_rows(1003, 0.9, 7)), kept)


def test_rows_slice_and_mask_across_frames():
    import numpy as np
    import pandas as pd

    from finetune.parquet_batches import Rows

    rows = Rows(10, lambda: (pd.DataFrame({"i": range(s, min(s + 3, 10))})
                             for s in range(0, 10, 3)))
    taken = lambda r: [i for f in r.frames() for i in f["i"]]  # noqa: E731
    assert taken(rows.slice(2, 7)) == [2, 3, 4, 5, 6] and rows.slice(2, 7).count == 5
    assert taken(Rows.chain([rows.head(2), rows.slice(8, 20)])) == [0, 1, 8, 9]
    mask = np.arange(10) % 4 == 1
    assert taken(rows.where(mask)) == [1, 5, 9] and rows.where(mask).count == 3


def test_row_groups_keep_one_type_per_column(tmp_path):
    import pandas as pd
    import pyarrow.parquet as pq

    from finetune.parquet_batches import RowGroupWriter

    with RowGroupWriter(tmp_path / "a.parquet", group_rows=2) as writer:
        writer.write(pd.DataFrame({"n": [1, 2]}))
        writer.write(pd.DataFrame({"n": [None, 4.0]}))  # pandas' float for a gap
    assert pq.read_table(tmp_path / "a.parquet")["n"].to_pylist() == [1, 2, None, 4]
    with pytest.raises(PipelineError, match=r"b.parquet, rows from 2: column 'n' is int64 in "
                       r"the first rows but string later"):
        with RowGroupWriter(tmp_path / "b.parquet", group_rows=2) as writer:
            writer.write(pd.DataFrame({"n": [1, 2]}))
            writer.write(pd.DataFrame({"n": ["x", "y"]}))


def test_a_split_is_saved_as_the_bytes_save_to_disk_writes(tmp_path):
    """The tokenize stage streams a split's Arrow file into its saved folder (resident memory
    flat); the files must be save_to_disk's, byte for byte: batches of uneven sizes (dropped
    rows, an empty one), a boolean column (its padding bits follow where batches are cut),
    one shard and three (cut inside batches)."""
    import datasets
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter

    from tasks.saved_split import _size, save_split

    arrow = tmp_path / "split.arrow"
    with ArrowWriter(path=str(arrow)) as writer:
        start = 0
        for size in (1000, 997, 0, 1000, 13, 1000, 512):
            rows = range(start, start + size)
            writer.write_table(pa.table({
                "input_ids": pa.array([[i % 7] * (i % 5 + 1) for i in rows], pa.list_(pa.int32())),
                "truncated": pa.array([i % 3 == 0 for i in rows], pa.bool_()),
                "length": pa.array([i % 5 + 1 for i in rows], pa.int64())}))
            start += size
        writer.finalize()
    ds = datasets.Dataset.from_file(str(arrow))
    ds._fingerprint = "0123456789abcdef-length"
    assert _size(arrow)[1:] == (len(ds), ds._estimate_nbytes())  # what picks the shard count

    def files(folder: Path) -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}

    for shards in (None, 3):
        ours, theirs = tmp_path / f"ours-{shards}", tmp_path / f"theirs-{shards}"
        save_split(arrow, ds._fingerprint, ours, num_shards=shards)
        ds.save_to_disk(str(theirs), num_shards=shards)
        assert len(files(ours)) == (shards or 1) + 2
        assert files(ours) == files(theirs), shards
    assert datasets.load_from_disk(str(ours))["length"] == [i % 5 + 1 for i in range(start)]


def _worker_signals(batch: dict) -> dict:
    import signal

    return {"handlers": [f"{signal.getsignal(signal.SIGTERM)} {signal.getsignal(signal.SIGINT)}"]
            * len(batch["i"])}


def test_tokenize_workers_die_on_sigterm_whatever_the_command_installed():
    """The stage's CLI turns SIGTERM into an exception; a forked pool worker that kept that
    handler could miss Pool.terminate's SIGTERM and wait forever (a hang seen in a test run):
    the workers get the default SIGTERM back and leave SIGINT to the parent."""
    import signal

    import pyarrow as pa

    from flows.cli import _raise_interrupted
    from tasks.tokenize import _encoded_batches

    batches = [pa.record_batch({"i": [1, 2]}), pa.record_batch({"i": [3]})]
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        with _encoded_batches(iter(batches), _worker_signals, {}, 2) as tables:
            seen = {h for t in tables for h in t.column("handlers").to_pylist()}
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == {f"{signal.SIG_DFL} {signal.SIG_IGN}"}
