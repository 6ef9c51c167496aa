"""`finetune reproduce`: a registered model rebuilt from a fresh clone with only the DVC remote
and the MLflow store, bit for bit; a remote with one input byte changed refused, naming it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import BIN, copy_project, error_line, run_cli

MODEL = "finetune-default"


def dvc(project: Path, *args: str) -> None:
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=project, capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"dvc {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


def store_uri(original: Path) -> str:
    return f"sqlite:///{original / 'mlflow.db'}"


def clone(original: Path, dest: Path, remote: Path) -> Path:
    """A fresh clone of the original's git repo, its default DVC remote `remote`."""
    subprocess.run(["git", "clone", "-q", str(original), str(dest)], check=True,
                   capture_output=True)
    dvc(dest, "remote", "add", "--local", "--default", "--force", "shared", str(remote))
    return dest


#: two whole pipeline runs: `make test-slow`, .ci/run's second step (make test leaves it out)
pytestmark = pytest.mark.clean_room

@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """The shrunk default run made by `dvc repro` and pushed to a local remote (registered
    as v1 by its export stage); then everything but its git repo and MLflow store deleted:
    its outputs, its DVC cache. Yields (original, remote, what the export wrote)."""
    base = tmp_path_factory.mktemp("reproduce")
    # the contamination check (half the evaluate stage here) changes no weights: off
    original = copy_project(base / "original", {"eval.contamination_ngram": None})
    remote = base / "remote"
    dvc(original, "remote", "add", "--local", "--default", "--force", "shared", str(remote))
    dvc(original, "repro")
    dvc(original, "push")
    kept = base / "kept"  # for the comparison test: the export and its metrics
    shutil.copytree(original / "data/export", kept / "data/export")
    shutil.copytree(original / "data/metrics", kept / "data/metrics")
    shutil.rmtree(original / ".dvc/cache")
    for out in ("raw", "formatted", "tokenized", "checkpoints", "trained", "export"):
        shutil.rmtree(original / "data" / out)
    return original, remote, kept


@pytest.mark.slow
def test_a_registered_model_rebuilds_bit_for_bit_from_a_fresh_clone(registered, tmp_path):
    original, remote, kept = registered
    from tasks.tracking import client_for

    client = client_for(store_uri(original))
    tags = client.get_model_version(MODEL, "1").tags
    weights = {k for k in tags if k.startswith("weights_sha256.")}
    assert weights == {"weights_sha256.model.safetensors",
                       "weights_sha256.adapter/adapter_model.safetensors"}, weights
    fresh = clone(original, tmp_path / "clone", remote)
    proc = run_cli(fresh, "reproduce", f"models:/{MODEL}@champion",
                   "--tracking-uri", store_uri(original))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("reproduced bit for bit"), proc.stdout[-2000:]
    assert "adapter/adapter_model.safetensors: sha256" in proc.stdout
    # the rebuild logged into a store of its own and left no worktree behind
    assert [str(v.version) for v in client.search_model_versions(f"name='{MODEL}'")] == ["1"]
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=fresh, capture_output=True,
                               text=True, check=True).stdout.splitlines()
    assert len(worktrees) == 1, worktrees


def raw_files(remote: Path, original: Path) -> dict[str, Path]:
    """data/raw's files (path in the project -> its object in the remote), by the md5 the
    registered version's lineage recorded."""
    from mlflow.artifacts import load_dict

    from tasks.tracking import client_for

    client = client_for(store_uri(original))
    run = client.get_run(client.get_model_version(MODEL, "1").run_id)
    md5 = load_dict(f"{run.info.artifact_uri}/lineage.json")["dvc_out.data/raw"]

    def obj(md5: str) -> Path:
        return remote / "files/md5" / md5[:2] / md5[2:]

    return {f"data/raw/{e['relpath']}": obj(e["md5"])
            for e in json.loads(obj(md5).read_text())}


def test_a_changed_input_byte_in_the_remote_is_refused_naming_that_input(registered, tmp_path):
    original, remote, _ = registered
    altered = tmp_path / "remote"
    shutil.copytree(remote, altered)
    files = raw_files(altered, original)
    name, obj = sorted(files.items())[-1]
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    fresh = clone(original, tmp_path / "clone", altered)
    proc = run_cli(fresh, "reproduce", f"models:/{MODEL}/1", "--tracking-uri",
                   store_uri(original))
    line = error_line(proc)
    md5 = obj.parent.name + obj.name
    assert f"input {name} (md5 {md5}) does not match its hash in the DVC remote" in line, line
    assert "Running stage" not in proc.stdout  # refused before anything ran

    obj.unlink()  # now missing altogether
    proc = run_cli(fresh, "reproduce", f"models:/{MODEL}/1", "--tracking-uri",
                   store_uri(original))
    assert f"input {name} (md5 {md5}) is missing from the DVC remote" in error_line(proc)


@pytest.mark.parametrize("uri, said", [
    (f"models:/{MODEL}/9", f"registered model '{MODEL}' has no version 9"),
    (f"models:/{MODEL}@nosuch", f"registered model '{MODEL}' has no alias 'nosuch'"),
    ("models:/nosuch/1", "no registered model 'nosuch'"),
    (f"{MODEL}/1", f"'{MODEL}/1' is not a registered model URI"),
])
def test_bad_model_uris_get_one_line_and_exit_2(registered, uri, said, capsys):
    from flows.cli import main

    original, _, _ = registered
    code = main(["reproduce", uri, "--tracking-uri", store_uri(original),
                 "-p", str(original / "params/default.yaml")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and said in err, (code, err)


def test_a_differing_weight_file_is_named_with_its_distance_and_the_gate_metric(registered,
                                                                                tmp_path):
    """What a rebuild that differs prints: the first differing file, the max abs difference
    from the registered model's tensors, the gate metric of both."""
    import torch
    from safetensors.torch import load_file, save_file

    from tasks.reproduce import compare, resolve
    from tasks.tracking import client_for

    original, _, kept = registered
    tree = tmp_path / "tree"
    shutil.copytree(kept, tree)
    weights = tree / "data/export/model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + torch.full_like(tensors[name], 0.25)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    metrics = json.loads((tree / "data/metrics/eval.json").read_text())
    registered_loss = metrics["finetuned"]["loss"]
    metrics["finetuned"]["loss"] = registered_loss + 1
    (tree / "data/metrics/eval.json").write_text(json.dumps(metrics))
    client = client_for(store_uri(original))
    said = []
    assert compare(client, resolve(client, f"models:/{MODEL}/1"), tree, said.append) == 1
    assert said[0].startswith("  adapter/adapter_model.safetensors: sha256") and \
        said[0].endswith("same"), said
    assert said[-1].startswith(f"model.safetensors differs from models:/{MODEL}/1's: "
                               f"max abs difference 0.25 over "), said
    assert f"(largest in {name}); eval.loss registered {registered_loss:.6g}, reproduced " \
           f"{registered_loss + 1:.6g}" in said[-1], said
    # where the numerics differ (another CPU under native numerics), within a tolerance
    said.clear()
    assert compare(client, resolve(client, f"models:/{MODEL}/1"), tree, said.append,
                   tolerance=0.9) == 0
    assert said[-1].startswith("reproduced within tolerance: max abs difference 0.25 over "), said
    said.clear()
    assert compare(client, resolve(client, f"models:/{MODEL}/1"), tree, said.append,
                   tolerance=1e-6) == 1
    assert said[-1].startswith(f"model.safetensors differs from models:/{MODEL}/1's: "
                               f"max abs difference 0.25 over "), said
    assert ", allowed 1e-06 of the largest weight; eval.loss registered" in said[-1], said


def test_only_what_the_pipeline_writes_leaves_the_tree_clean(tmp_path):
    """`dvc repro` rewrites dvc.lock and the metrics kept in git while it runs: the lineage
    still records a clean tree (else no real run could be reproduced); a code edit does not."""
    from helpers import ROOT

    from tasks.tracking import git_info

    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    for name in ("dvc.lock", "data/metrics/eval.json", "code.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("1\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "c"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "dvc.lock").write_text("2\n")
    (tmp_path / "data/metrics/eval.json").write_text("2\n")
    assert git_info(tmp_path)["git_dirty"] == "false"
    (tmp_path / "code.py").write_text("2\n")
    assert git_info(tmp_path)["git_dirty"] == "true"
