"""Benchmark plumbing: a throwaway copy of the project and the stage CLI run inside it.

Benchmarks never touch the working tree: they copy the tracked files into a temp folder (its
own git repo, DVC and MLflow store), shrink or change params there, and run the same
`finetune stage NAME` commands users run.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: the benchmarks' datasets and models beyond what the project ships (Alpaca's alpaca_2k.json
#: under data/, the GPT-2 tokenizer under models/gpt2-tokenizer): FINETUNE_BENCH_DATA names the
#: folder; by default a `shared` folder beside the project
SHARED = Path(os.environ.get("FINETUNE_BENCH_DATA", ROOT.parent / "shared"))
OUTPUTS = ("data/raw/", "data/formatted/", "data/tokenized/", "data/trained/", "data/checkpoints/",
           "data/export/", "data/metrics/", "data/plots/", "dvc.lock")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# stage commands (`finetune`, `dvc`) come from this interpreter's environment
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def copy_project(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for rel in files:
        if rel and not rel.startswith(OUTPUTS) and (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.com"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "bench"]):
        subprocess.run(cmd, cwd=dest, check=True, capture_output=True, env=env)
    return dest


def set_params(project: Path, overrides: dict) -> None:
    from finetune.config.loader import set_keys

    path = project / "params/default.yaml"
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump(set_keys(raw, overrides), sort_keys=False))


def stage(project: Path, name: str) -> float:
    """Run one stage; returns its wall time. Output is kept in <project>/bench-<stage>.log."""
    started = time.perf_counter()
    with open(project / f"bench-{name}.log", "w") as log:
        proc = subprocess.run([str(BIN / "finetune"), "stage", name], cwd=project, stdout=log,
                              stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"stage {name} failed in {project}; see bench-{name}.log there")
    return time.perf_counter() - started


def read_json(project: Path, rel: str) -> dict:
    return json.loads((project / rel).read_text())


def train_metrics(project: Path) -> dict:
    """The train stage's final metrics with its timings (data/logs/train_timings.json)."""
    timings = project / "data/logs/train_timings.json"
    return {**read_json(project, "data/metrics/train.json"),
            **(json.loads(timings.read_text()) if timings.exists() else {})}


def machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:  # the flags that decide kernels (AVX-512, AVX512-BF16, AMX): bf16 ratios need them
        from finetune.numerics import cpu as cpu_info

        flags = cpu_info()["flags"]
    except ImportError:  # a GPU machine's bare environment
        flags = "unknown"
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "python": platform.python_version()}


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4f}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)
