"""`finetune reproduce MODEL_URI`: rebuild a registered model in a clean room, check its bytes.

A registered version's run holds its lineage (`lineage.json`: git commit and dirty flag, params
file, the md5 DVC keeps each stage's outs under) and the version holds the sha256 of each weight
file it was registered with (`weights_sha256.<file>` tags, tasks/registry.py). Reproduction
needs nothing of the machine that trained it: the commit is checked out in a temporary git
worktree; the inputs (the download stage's outs: the data as it was taken in, which a hub
dataset may no longer give) come from the DVC remote by their recorded md5, each file's bytes
checked against its hash (DVC itself trusts the remote); the params file at that commit must
resolve to the params the run recorded; then `dvc repro` runs every stage downstream of the
inputs, and the export's weight files are compared with the registered sha256. The rebuild
logs into an MLflow store inside the worktree, never the registry it checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import yaml

from finetune import numerics
from finetune.config.model_refs import REGISTERED_MODEL
from finetune.errors import PipelineError
from tasks import registry, tracking

#: the stage whose outs are the run's inputs; every other stage is recomputed from them
INPUT_STAGE = "download"
#: the name the worktree knows this checkout's default remote by
REMOTE = "reproduce"
#: the largest weight difference allowed where numerics differ, relative to the largest
#: registered weight (the default run's adapters trained with native AVX-512 numerics and with
#: portable ones differ by 4.5e-6, 1.7e-5 of the largest adapter weight)
DEFAULT_TOLERANCE = 1e-3


class RebuildFailed(PipelineError):
    """A stage failed while rebuilding: not bad input, and not a verdict on the model."""

    exit_code = 1


@dataclass
class Registered:
    """The version to reproduce and what it recorded."""

    uri: str
    name: str
    version: str
    run_id: str
    lineage: dict[str, str]
    params: dict  # the run's resolved params (its resolved_params.json)
    weights: dict[str, str]  # export-relative weight file -> sha256
    gate_metric: str
    gate_value: float | None


def resolve(client, uri: str) -> Registered:
    """`models:/NAME/VERSION` or `models:/NAME@ALIAS` -> the version and its records."""
    from mlflow.exceptions import MlflowException

    match = REGISTERED_MODEL.fullmatch(uri)
    if not match:
        raise PipelineError(f"'{uri}' is not a registered model URI: use models:/NAME/VERSION "
                            "or models:/NAME@ALIAS")
    name, number, alias = match["name"], match["version"], match["alias"]
    try:
        client.get_registered_model(name)
    except MlflowException:
        raise PipelineError(f"no registered model '{name}' in {client.tracking_uri}") from None
    try:
        mv = (client.get_model_version(name, number) if number
              else client.get_model_version_by_alias(name, alias))
    except MlflowException:
        what = f"version {number}" if number else f"alias '{alias}'"
        raise PipelineError(f"registered model '{name}' has no {what} "
                            f"({client.tracking_uri})") from None
    label = f"{name} v{mv.version}"
    if not mv.run_id:
        raise PipelineError(f"{label} has no training run: no lineage to reproduce it from")
    weights = {k.removeprefix(registry.WEIGHTS_TAG): v for k, v in mv.tags.items()
               if k.startswith(registry.WEIGHTS_TAG)}
    if not weights:
        raise PipelineError(f"{label} records no {registry.WEIGHTS_TAG}* tags (registered "
                            "before they were recorded): there is nothing to compare a rebuild "
                            "with")
    run = client.get_run(mv.run_id)
    with registry.use_tracking_uri(client.tracking_uri):
        from mlflow.artifacts import load_dict

        try:
            lineage = load_dict(f"{run.info.artifact_uri}/{tracking.LINEAGE_ARTIFACT}")
            params = load_dict(f"{run.info.artifact_uri}/resolved_params.json")
        except (MlflowException, OSError) as exc:
            raise PipelineError(f"{label}'s run {mv.run_id} has no lineage.json or "
                                f"resolved_params.json artifact ({exc})") from None
    metric = run.data.params.get("registry.gate_metric", "eval.loss")
    tagged = mv.tags.get(registry.gate_tag(metric))
    value = float(tagged) if tagged is not None else run.data.metrics.get(metric)
    return Registered(f"models:/{name}/{mv.version}", name, str(mv.version), mv.run_id, lineage,
                      params, weights, metric, value)


def _say(line: str) -> None:
    print(line, flush=True)  # before the output of the commands it starts


def reproduce(root: Path, uri: str, tracking_uri: str, keep: bool = False,
              say: Callable[[str], None] = _say, tolerance: float | None = None) -> int:
    """Rebuild `uri` from its lineage; 0 when every weight file matches its registered
    sha256, 1 when one differs (first differing file, how far apart, the gate metric of
    both). Where this machine's numerics differ from the registered run's (numerics_differ),
    bytes cannot be expected equal: the weights are compared within `tolerance` (relative
    to the largest weight; None: DEFAULT_TOLERANCE) instead, and it says so. Input that cannot
    be reproduced (dirty tree, unknown commit, missing or altered inputs in the remote)
    raises PipelineError."""
    if tolerance is not None and not 0 <= tolerance < 1:
        raise PipelineError(f"--tolerance {tolerance:g}: a relative difference in [0, 1)")
    client = tracking.client_for(tracking_uri)
    reg = resolve(client, uri)
    differ = numerics_differ(reg)
    if differ:
        tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
        say(f"numerics differ from the registered run's ({differ}): comparing the weights "
            f"within {tolerance:g} of the largest weight instead of bit for bit")
    commit = _commit_of(root, reg)
    inputs = _inputs(root, commit, reg)
    remote = _remote_url(root)
    say(f"{reg.uri}: commit {commit[:12]}, {reg.lineage.get('params_file')}, inputs "
        + ", ".join(f"{path} (md5 {md5})" for path, md5 in inputs.items()) + f" from {remote}")
    tree = Path(tempfile.mkdtemp(prefix="finetune-reproduce-")) / "tree"
    try:
        _git(root, "worktree", "add", "--detach", str(tree), commit)
        _fetch_inputs(tree, remote, inputs)
        _check_params(tree, reg)
        started = time.perf_counter()
        _repro(tree, inputs, reg)
        say(f"rebuilt in {tree} ({time.perf_counter() - started:.1f}s)")
        return compare(client, reg, tree, say, tolerance=tolerance if differ else None)
    finally:
        if keep:
            say(f"kept the worktree: {tree} (remove it with: git worktree remove --force {tree})")
        else:
            _git(root, "worktree", "remove", "--force", str(tree), check=False)
            shutil.rmtree(tree.parent, ignore_errors=True)


def _git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise PipelineError(f"git {' '.join(args)} failed in {root}: {proc.stderr.strip()}")
    return proc


def _commit_of(root: Path, reg: Registered) -> str:
    label = f"{reg.name} v{reg.version}"
    commit = reg.lineage.get("git_commit", "none")
    if commit == "none":
        raise PipelineError(f"{label}'s lineage records no git commit (trained outside a git "
                            "checkout): its code cannot be checked out again")
    if reg.lineage.get("git_dirty") == "true":
        raise PipelineError(f"{label} was trained from a dirty tree (uncommitted changes on "
                            f"{commit[:12]}): the code and params it ran are in no commit")
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
        raise PipelineError(f"commit {commit} ({label}'s lineage) is not in this clone "
                            f"({root}): fetch it (git fetch) and run again")
    return commit


def _inputs(root: Path, commit: str, reg: Registered) -> dict[str, str]:
    """The input stage's outs at `commit` -> the md5 the lineage recorded for each."""
    text = _git(root, "show", f"{commit}:dvc.yaml").stdout
    stage = (yaml.safe_load(text) or {}).get("stages", {}).get(INPUT_STAGE, {})
    paths = [next(iter(out)) if isinstance(out, dict) else out for out in stage.get("outs", [])]
    missing = [p for p in paths if f"dvc_out.{p}" not in reg.lineage]
    if not paths or missing:
        raise PipelineError(f"{reg.name} v{reg.version}'s lineage records no DVC hash of "
                            f"{', '.join(missing) or 'the ' + INPUT_STAGE + ' stage outs'} "
                            "(not trained through dvc repro): its inputs cannot be fetched")
    return {p: reg.lineage[f"dvc_out.{p}"] for p in paths}


def _remote_url(root: Path) -> str:
    """This checkout's default DVC remote (config.local included), relative paths made
    absolute: the worktree sits elsewhere."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        config = repo.config
        name = config["core"].get("remote")
        if not name or name not in config["remote"]:
            raise PipelineError(f"{root} has no default DVC remote (dvc remote add -d NAME "
                                "URL): the inputs are fetched from it")
        return str(config["remote"][name]["url"])


def _dvc(tree: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=tree, capture_output=True,
                          text=True, env=_env(tree))
    if check and proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise PipelineError(f"dvc {' '.join(args)} failed in {tree}: "
                            f"{last[-1] if last else proc.returncode}")
    return proc


def _env(tree: Path) -> dict[str, str]:
    """The worktree's code first (the commit's, not this checkout's), this venv's commands
    (dvc.yaml's `finetune stage`), an MLflow store of its own."""
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PYTHONPATH": str(tree),
            "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tree / 'mlflow.db'}"}


def _fetch_inputs(tree: Path, remote: str, inputs: dict[str, str]) -> None:
    """Each input's objects from the remote into the worktree's cache, every file's bytes
    checked against its md5 (DVC fetches without checking), then checked out. The input
    stage's dvc.lock entry is the recorded one, whatever the commit's dvc.lock says."""
    _dvc(tree, "remote", "add", "--local", "--default", "--force", REMOTE, remote)
    lock_path = tree / "dvc.lock"
    lock = (yaml.safe_load(lock_path.read_text()) if lock_path.exists() else None) or {}
    lock.setdefault("schema", "2.0")
    stages = lock.setdefault("stages", {})
    stage = yaml.safe_load((tree / "dvc.yaml").read_text())["stages"][INPUT_STAGE]
    stages[INPUT_STAGE] = {"cmd": stage["cmd"],
                           "outs": [{"path": p, "hash": "md5", "md5": md5}
                                    for p, md5 in inputs.items()]}
    lock_path.write_text(yaml.safe_dump(lock, sort_keys=False))
    fetched = _dvc(tree, "fetch", INPUT_STAGE, check=False)  # what failed is named below
    from dvc.repo import Repo

    with Repo(str(tree)) as repo:
        cache, stored = repo.cache.local, repo.cloud.get_remote_odb(REMOTE)
        objects = [(f"input {rel} (md5 {want})", want, Path(cache.oid_to_path(want)))
                   for path, md5 in inputs.items() for rel, want in _objects(cache, stored,
                                                                              path, md5)]
        for where, want, _ in objects:
            if not stored.fs.exists(stored.oid_to_path(want)):
                raise PipelineError(f"{where} is missing from the DVC remote {remote}")
    for where, want, got in objects:
        if not got.is_file():
            lines = (fetched.stderr.strip() or fetched.stdout.strip()).splitlines()
            raise PipelineError(f"{where} could not be fetched from the DVC remote {remote}: "
                                f"{lines[-1] if lines else 'dvc fetch failed'}")
        if _md5(got) != want.removesuffix(".dir"):
            raise PipelineError(f"{where} does not match its hash in the DVC remote "
                                f"{remote}: its bytes hash to {_md5(got)}")
    _dvc(tree, "checkout", INPUT_STAGE)


def _objects(cache, stored, path: str, md5: str) -> list[tuple[str, str]]:
    """(path, md5) of an out's objects: itself, and for a folder each file its listing (the
    `.dir` object: from the cache, else straight from the remote when DVC fetched none of
    the folder; unread when it does not match its own hash) names."""
    found = [(path, md5)]
    if not md5.endswith(".dir"):
        return found
    local, remote = Path(cache.oid_to_path(md5)), stored.oid_to_path(md5)
    if local.is_file():
        listing = local.read_bytes()
    elif stored.fs.exists(remote):
        with stored.fs.open(remote, "rb") as fh:
            listing = fh.read()
    else:
        return found
    if hashlib.md5(listing).hexdigest() == md5.removesuffix(".dir"):
        found += [(f"{path}/{e['relpath']}", e["md5"]) for e in json.loads(listing)]
    return found


def _md5(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "md5").hexdigest()


def _check_params(tree: Path, reg: Registered) -> None:
    """The params file at the commit must resolve (with the commit's code) to the params
    the run recorded: a run started with overrides (-s) cannot be replayed by dvc repro."""
    params_file = reg.lineage.get("params_file", "params/default.yaml")
    finetune = Path(sys.executable).with_name("finetune")  # dvc.yaml's command, as dvc runs it
    proc = subprocess.run([str(finetune) if finetune.exists() else "finetune", "config",
                           "-p", params_file],
                          cwd=tree, capture_output=True, text=True, env=_env(tree))
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise PipelineError(f"{params_file} at the commit does not load: "
                            f"{lines[-1] if lines else proc.returncode}")
    here = tracking.flatten(yaml.safe_load(proc.stdout))
    recorded = tracking.flatten(reg.params)
    for key in sorted(set(here) | set(recorded)):
        if here.get(key) != recorded.get(key):
            raise PipelineError(
                f"{params_file} at commit {reg.lineage['git_commit'][:12]} gives {key}="
                f"{here.get(key)}, but {reg.name} v{reg.version}'s run recorded "
                f"{recorded.get(key)} (trained with overrides?): dvc repro cannot replay it")


def _repro(tree: Path, inputs: dict[str, str], reg: Registered) -> None:
    """`dvc repro` of every stage downstream of the inputs, forced (nothing is taken from a
    run cache), its output passed through. A tracking URI in the params is cleared (no DVC
    output records it), so the rebuild logs into the worktree's store, never the real one."""
    params_file = tree / reg.lineage.get("params_file", "params/default.yaml")
    if (reg.params.get("logging") or {}).get("mlflow_tracking_uri"):
        raw = yaml.safe_load(params_file.read_text())
        raw["logging"]["mlflow_tracking_uri"] = None
        params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    stages = yaml.safe_load((tree / "dvc.yaml").read_text())["stages"]
    first = [name for name, body in stages.items() if name != INPUT_STAGE
             and any(str(dep) in inputs for dep in body.get("deps", []))]
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "--force", "--downstream",
                           *first], cwd=tree, env=_env(tree))
    if proc.returncode != 0:
        raise RebuildFailed(f"dvc repro failed in {tree} (exit {proc.returncode}); the "
                            "failing stage's error is printed above")


def numerics_differ(reg: Registered) -> str | None:
    """Why a rebuild here need not give the registered bytes (finetune.numerics.comparable:
    another mode, pins or thread count, or native numerics on another CPU), or None."""
    params = reg.params
    cfg = SimpleNamespace(
        training=SimpleNamespace(
            cpu_numerics=(params.get("training") or {}).get("cpu_numerics", numerics.NATIVE),
            resolved_device="cpu" if (params.get("training") or {}).get("use_cpu")
            else (params.get("training") or {}).get("device", "auto")),
        distributed=SimpleNamespace(
            threads_per_process=(params.get("distributed") or {}).get("threads_per_process"),
            nproc_per_node=(params.get("distributed") or {}).get("nproc_per_node", 1)))
    return numerics.comparable(reg.lineage, numerics.settings(numerics.plan(cfg)))


def compare(client, reg: Registered, tree: Path, say: Callable[[str], None] = print,
            tolerance: float | None = None) -> int:
    """The weight files `tree`'s export produced against the registered sha256: 0 when all
    match; else 1, with the first differing file, how far apart and the gate metric of both.
    `tolerance` (numerics that differ): differing bytes pass when every weight is within
    tolerance x the largest registered weight."""
    export = tree / "data/export"
    produced = registry.weight_hashes(export) if export.is_dir() else {}
    differing = None
    for rel in sorted(reg.weights):
        same = produced.get(rel) == reg.weights[rel]
        say(f"  {rel}: sha256 {reg.weights[rel][:16]}... "
            + ("same" if same else f"registered, {(produced.get(rel) or 'missing')[:16]}... "
               "reproduced"))
        if not same and differing is None:
            differing = rel
    if differing is None:
        say("reproduced bit for bit")
        return 0
    gap = _gap(client, reg, export)
    mine = _gate_value(tree, reg.gate_metric)
    metric = (f"{reg.gate_metric} registered {_number(reg.gate_value)}, reproduced "
              f"{_number(mine)}")
    if tolerance is not None and gap.relative is not None and gap.relative <= tolerance:
        say(f"reproduced within tolerance: {gap.text()} ({gap.relative:.3g} of the largest "
            f"weight, allowed {tolerance:g}); {metric}")
        return 0
    allowed = "" if tolerance is None else f", allowed {tolerance:g} of the largest weight"
    say(f"{differing} differs from {reg.uri}'s: {gap.text()}{allowed}; {metric}")
    return 1


def _number(value: float | None) -> str:
    return "none" if value is None else f"{value:.6g}"


def _gate_value(tree: Path, metric: str) -> float | None:
    path = tree / "data/metrics/eval.json"
    if not path.exists():
        return None
    value = (json.loads(path.read_text()).get("finetuned") or {}).get(metric.removeprefix("eval."))
    return None if value is None else float(value)


def _gap(client, reg: Registered, export: Path) -> "Gap":
    """How far the reproduced weights are from the registered ones, the registered side read
    from the version's MLflow model (the merged weights), the reproduced side from the export
    folder's safetensors."""
    with tempfile.TemporaryDirectory() as tmp, registry.use_tracking_uri(client.tracking_uri):
        from mlflow.artifacts import download_artifacts

        folder = Path(download_artifacts(artifact_uri=reg.uri, dst_path=tmp))
        return weights_gap(_tensors(folder), _tensors(export))


def _tensors(folder: Path) -> dict:
    """Every tensor of the safetensors files under `folder`, by name (MLflow keeps the model
    one folder down; the adapter's names never clash with the merged model's)."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.rglob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@dataclass
class Gap:
    """The largest difference between two sets of weights over the tensors both name, and
    that difference relative to the largest registered weight (None when not comparable)."""

    why_not: str | None = None  # no common tensor, or a shape that differs
    largest: float = 0.0
    tensor: str = ""
    tensors: int = 0
    scale: float = 0.0

    @property
    def relative(self) -> float | None:
        if self.why_not is not None:
            return None
        return self.largest / self.scale if self.scale else float(self.largest > 0)

    def text(self) -> str:
        return self.why_not or (f"max abs difference {self.largest:.3g} over {self.tensors} "
                                f"tensors (largest in {self.tensor})")


def weights_gap(registered: dict, reproduced: dict) -> Gap:
    """The Gap over the tensors both name."""
    common = sorted(set(registered) & set(reproduced))
    if not common:
        return Gap("no tensor names in common with the registered model")
    for name in common:
        if registered[name].shape != reproduced[name].shape:
            return Gap(f"tensor {name} has shape {tuple(reproduced[name].shape)}, registered "
                       f"{tuple(registered[name].shape)}")
    gaps = {name: float((registered[name].double() - reproduced[name].double()).abs().max())
            for name in common}
    worst = max(common, key=gaps.__getitem__)
    scale = max(float(registered[name].double().abs().max()) for name in common)
    return Gap(None, gaps[worst], worst, len(common), scale)

