"""Stage-level benchmarks: tokenize stage vs bare batched `tokenizer(...)`, and pipeline
overheads (`dvc repro` no-op, orchestration share of a default run)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd

from workdir import BIN, SHARED, set_params, train_metrics

GPT2 = SHARED / "models/gpt2-tokenizer"


def tokenize_throughput(project: Path, repeats: int = 10) -> dict:
    """Alpaca prompt/completion texts (x repeats), GPT-2 tokenizer: the tokenize stage
    (in-process, the function `finetune stage tokenize` runs) vs one batched tokenizer call
    over the same prompts and completions."""
    from transformers import AutoTokenizer, GPT2Config

    from finetune.config import load_config
    from finetune.workspace import Workspace
    from tasks.tokenize import tokenize

    model_dir = project / "gpt2-tok"
    shutil.copytree(GPT2, model_dir)
    GPT2Config(n_positions=1024).save_pretrained(model_dir)  # max_positions for the length check
    set_params(project, {"model.name_or_path": str(model_dir), "data.max_seq_length": 1024,
                         "data.max_dropped_fraction": 0.5})
    formatted = project / "data/formatted"
    for split in ("train", "test"):
        frame = pd.read_parquet(formatted / f"{split}.parquet")
        pd.concat([frame] * repeats, ignore_index=True).to_parquet(formatted / f"{split}.parquet")
    texts = pd.concat([pd.read_parquet(f) for f in sorted(formatted.glob("*.parquet"))])
    n_tokens_rows = len(texts)

    tok = AutoTokenizer.from_pretrained(model_dir)
    started = time.perf_counter()
    ids = tok(texts["prompt"].tolist(), add_special_tokens=False)["input_ids"]
    ids2 = tok(texts["completion"].tolist(), add_special_tokens=False)["input_ids"]
    bare = time.perf_counter() - started
    tokens = sum(map(len, ids)) + sum(map(len, ids2))
    from finetune.datatypes.encoding import token_ids

    if token_ids(tok, texts["prompt"].tolist() + texts["completion"].tolist()) != ids + ids2:
        raise SystemExit("the stage's token ids differ from the bare tokenizer's: comparison void")
    del ids, ids2  # millions of live ints make every GC pass of the timed stage slower
    import gc

    gc.collect()

    ws = Workspace(config=load_config(project / "params/default.yaml"), root=project,
                   params_path=project / "params/default.yaml")
    started = time.perf_counter()
    tokenize(ws)
    ours = time.perf_counter() - started
    return {"rows": n_tokens_rows, "tokens": tokens, "bare_tok_s": tokens / bare,
            "stage_tok_s": tokens / ours, "stage_vs_bare": bare / ours,
            "bare_s": bare, "stage_s": ours}


def pipeline_overheads(project: Path) -> dict:
    """A full default run with `dvc repro` (the README's job), then a no-op repro."""
    dvc = str(BIN / "dvc")
    started = time.perf_counter()
    proc = subprocess.run([dvc, "repro"], cwd=project, capture_output=True, text=True)
    total = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"dvc repro failed in {project}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    train_wall = _stage_wall(proc.stdout, project)
    noops = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([dvc, "repro"], cwd=project, check=True, capture_output=True)
        noops.append(time.perf_counter() - started)
    m = train_metrics(project)
    return {"repro_total_s": total, "train_stage_s": train_wall,
            "orchestration_share": total / train_wall, "train_runtime_s": m["train_runtime"],
            "dvc_repro_noop_s": min(noops)}


def _stage_wall(stdout: str, project: Path) -> float:
    """The train stage's wall time, printed by the stage CLI ('[train] done in 12.3s')."""
    import re

    found = re.search(r"\[train\] done in ([\d.]+)s", stdout)
    if not found:
        raise SystemExit(f"no train stage time in the dvc repro output of {project}")
    return float(found.group(1))

