"""MLflow bookkeeping shared by the stages: one run per training, found again downstream.

The train stage opens the run, ends it (FINISHED, or FAILED when training fails) and records its
id in `data/lineage/train_run.json` (gitignored, outside DVC: the id names a run in this clone's
store), so evaluate and export, even when launched as separate DVC/Prefect steps, log into the
same run.
Lineage (git commit and dirty flag, params file, config fingerprint, data and dvc.lock hashes) is
one artifact, `lineage.json`, with a few of its entries as tags (LINEAGE_TAGS): some 40 tags
would bury the run's and each registered version's page.
The metrics page holds what changes per step and the final evaluation; facts about the run
(seed, world size, parameter counts, runtime) are tags (`train.<key>`), not one-point charts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from finetune import numerics
from finetune.config import config_fingerprint
from finetune.config.section import flatten as dotted
from finetune.files import file_sha256
from finetune.user_code import code_hashes
from finetune.workspace import Workspace


def _env_quiet() -> None:
    import logging

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def client(ws: Workspace):
    return client_for(ws.mlflow_uri())


def client_for(tracking_uri: str):
    _env_quiet()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def git_info(root: Path) -> dict[str, str]:
    """The commit and whether the tree differs from it, leaving out what the pipeline itself
    writes (dvc.lock, the outs and metrics kept in git): `dvc repro` rewrites those while it
    runs, which says nothing of the code and params that ran (`finetune reproduce` refuses a
    dirty tree)."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    written = [f":(exclude){path}" for path in pipeline_writes(root)]
    dirty = (bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", *written))
             if commit else False)
    return {"git_commit": commit or "none", "git_dirty": str(dirty).lower()}


def pipeline_writes(root: Path) -> list[str]:
    """dvc.lock and every path dvc.yaml lists as a stage's out, metric or plot."""
    dvc_yaml = root / "dvc.yaml"
    stages = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages", {}) \
        if dvc_yaml.exists() else {}
    paths = {next(iter(out)) if isinstance(out, dict) else out
             for body in stages.values() for kind in ("outs", "metrics", "plots")
             for out in body.get(kind, [])}
    return ["dvc.lock", *sorted(paths)]


def dvc_lock_hashes(root: Path) -> dict[str, str]:
    """`dvc.lock` stage -> short hash of its recorded deps/params/outs."""
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    import hashlib

    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    return {
        f"dvc_stage.{name}": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
        for name, body in stages.items()
    }


def dvc_out_hashes(root: Path) -> dict[str, str]:
    """`dvc.lock` outs -> the md5 DVC stores them under (`dvc_out.data/raw`: the dataset as
    DVC can check it out again from the cache or remote)."""
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    return {f"dvc_out.{out['path']}": out["md5"]
            for body in stages.values() for out in body.get("outs", []) if out.get("md5")}


def data_hashes(raw_dir: Path) -> dict[str, str]:
    """SHA-256 of each raw split file and of all of them together (`data_sha256`): the data
    identity recorded in the model card, the MLflow run and every registered version. A
    streamed train split is identified by `stream.json` (its source files' hashes); each
    source of a mixture (a folder of splits) also gets its own (`data_sha256.<source>`)."""
    import hashlib

    whole = hashlib.sha256()
    tags = {}
    files = sorted([*raw_dir.rglob("*.parquet"), *raw_dir.glob("stream.json")])
    sources: dict[str, Any] = {}
    for path in files:
        name = path.relative_to(raw_dir).as_posix()
        whole.update(name.encode())
        if path.parent != raw_dir:
            source = sources.setdefault(path.parent.name, hashlib.sha256())
            source.update(path.name.encode())
            tags[f"data_sha256.{name}"] = file_sha256(path, into=whole, also=source)
        else:
            tags[f"data_sha256.{name}"] = file_sha256(path, into=whole)
    tags.update({f"data_sha256.{name}": h.hexdigest() for name, h in sources.items()})
    return {"data_sha256": whole.hexdigest(), **tags}


#: the lineage entries shown as tags on the run and each registered version (the rest is in
#: the `lineage.json` artifact)
LINEAGE_TAGS = ("git_commit", "git_dirty", "params_file", "config_fingerprint", "data_sha256",
                "numerics.mode", "numerics.cpu_model")
LINEAGE_ARTIFACT = "lineage.json"


def lineage(ws: Workspace) -> dict[str, str]:
    """Everything needed to trace a model back to code, config and data."""
    return {
        **git_info(ws.root),
        "params_file": str(ws.params_path.relative_to(ws.root))
        if ws.params_path.is_relative_to(ws.root) else str(ws.params_path),
        "config_fingerprint": config_fingerprint(ws.config),
        "strategy": ws.config.distributed.strategy,
        "world_size": str(ws.config.distributed.world_size),
        # the CPU numerics it trained with and the CPU (what bitwise reproduction needs)
        **numerics.settings(numerics.plan(ws.config)),
        **data_hashes(ws.layout.raw),
        # the files of the tools, environments and reward functions the params name
        **{f"code_sha256.{key}": h for key, h in code_hashes(ws.config).items()},
        **dvc_lock_hashes(ws.root),
        **dvc_out_hashes(ws.root),
    }


MLFLOW_KEY = re.compile(r"[\w\-. :/]+")


def flatten(data: dict[str, Any]) -> dict[str, str]:
    """Nested config -> MLflow params `a.b.c`; a mapping whose keys MLflow cannot take as
    names (e.g. optimizer_groups' regexes) stays one JSON value."""
    flat = dotted(data, descend=lambda mapping: all(MLFLOW_KEY.fullmatch(k) for k in mapping))
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in flat.items()}


def start_run(ws: Workspace, extra_tags: dict[str, str] | None = None) -> str:
    """Create the MLflow run for a training; logs resolved params and lineage tags."""
    from mlflow.entities import Param

    c = client(ws)
    exp_name = ws.config.logging.experiment_name
    exp = c.get_experiment_by_name(exp_name)
    # The project's own store keeps artifacts next to it, whatever the working directory.
    local = ws.mlflow_uri() == f"sqlite:///{ws.root / 'mlflow.db'}"
    location = (ws.root / "mlruns").as_uri() if local else None
    exp_id = exp.experiment_id if exp else c.create_experiment(exp_name, location)
    traced = lineage(ws)
    run = c.create_run(exp_id, tags={**lineage_summary(traced), **(extra_tags or {})},
                       run_name=ws.config.logging.run_name)
    c.log_dict(run.info.run_id, traced, LINEAGE_ARTIFACT)
    params = flatten(ws.config.model_dump(mode="json"))
    items = [Param(k, v[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i : i + 100])
    c.log_dict(run.info.run_id, ws.config.model_dump(mode="json"), "resolved_params.json")
    return run.info.run_id


def run_id_of(ws: Workspace) -> str | None:
    path = ws.layout.train_run
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("mlflow_run_id")


def log_batch(mlflow_client, run_id: str, metrics: dict[str, float], step: int) -> None:
    """All metrics of one step in one MLflow request."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    mlflow_client.log_batch(run_id, metrics=[Metric(k, float(v), now, step)
                                             for k, v in metrics.items()])


def log_metrics(ws: Workspace, run_id: str, metrics: dict[str, float], step: int) -> None:
    log_batch(client(ws), run_id, metrics, step)


def lineage_summary(traced: dict[str, str]) -> dict[str, str]:
    """The few lineage entries shown as tags."""
    return {k: traced[k] for k in LINEAGE_TAGS if k in traced}


def log_lineage(ws: Workspace, run_id: str, traced: dict[str, str]) -> None:
    """The lineage as the run's `lineage.json` (replacing the one training logged: the export
    knows the later stages' dvc.lock entries too) and its summary as tags."""
    client(ws).log_dict(run_id, traced, LINEAGE_ARTIFACT)
    set_tags(ws, run_id, lineage_summary(traced))


def run_lineage(ws: Workspace, run_id: str) -> dict[str, str]:
    """The lineage start_run logged with the run (read back, not hashed again)."""
    from mlflow.artifacts import load_dict

    return load_dict(f"{client(ws).get_run(run_id).info.artifact_uri}/{LINEAGE_ARTIFACT}")


def step_logger(ws: Workspace, run_id: str):
    """row -> None: logs one training row ({"step": n, metric: value, ...}) to the run; one
    client for the whole training (the stage relays the worker's rows through it)."""
    c = client(ws)

    def log(row: dict) -> None:
        row = dict(row)
        step = int(row.pop("step"))
        log_batch(c, run_id, row, step)

    return log


def set_tags(ws: Workspace, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client(ws).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def finish_run(ws: Workspace, run_id: str, status: str = "FINISHED") -> None:
    client(ws).set_terminated(run_id, status=status)


def log_data_inputs(ws: Workspace, run_id: str, tokenized: Path, stats: dict) -> None:
    """Each tokenized split as one of the run's dataset inputs (mlflow.log_input's record:
    source the split's folder, digest the md5 DVC keeps the tokenized data under in dvc.lock,
    else a SHA-256 of the split's files; context train/eval), and the tokenize stage's
    statistics as a table artifact (data/tokenize_stats.json): not as metrics, where 30 of
    them would bury the loss curve."""
    _env_quiet()
    from mlflow.data.dataset_source_registry import get_registered_sources
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    from finetune.hashing import data_hash

    dvc_md5 = dvc_out_hashes(ws.root).get(f"dvc_out.{tokenized.relative_to(ws.root)}")
    splits = sorted(p for p in tokenized.iterdir() if p.is_dir()) if tokenized.is_dir() else []
    # the local-files source by name: MLflow registers it twice (for "" and "file:" URIs), and
    # resolving a file URI among the registered sources warns that it is ambiguous
    local = next(s for s in get_registered_sources() if s._get_source_type() == "local")
    inputs = []
    for folder in splits:
        digest = (dvc_md5 or data_hash(folder))[:36]  # MLflow keeps 36 characters
        dataset = MetaDataset(local(folder.resolve().as_uri()), name=folder.name, digest=digest)
        context = "train" if folder.name == "train" else "eval"
        inputs.append(DatasetInput(dataset._to_mlflow_entity(),
                                   [InputTag("mlflow.data.context", context)]))
    c = client(ws)
    if inputs:
        c.log_inputs(run_id, datasets=inputs)
    rows = [(split, key, value) for split, values in stats.items()
            for key, value in values.items() if isinstance(value, (int, float))]
    if rows:
        c.log_table(run_id, data={"split": [r[0] for r in rows],
                                  "statistic": [r[1] for r in rows],
                                  "value": [r[2] for r in rows]},
                    artifact_file="data/tokenize_stats.json")
