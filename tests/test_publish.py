"""`finetune publish`: only a version the gate promoted, its files and a model card with its
lineage and the gate's decision, to a Hub repo (a small Hub on 127.0.0.1 speaking the upload
API huggingface_hub uses: tests/hub_server.py), a folder or an fsspec URL; a second publish of
the same bytes uploads nothing. The model is registered for real: the train stage (torchrun,
its MLflow run on SQLite), evaluate and export, whose gate promotes v1 (the first model); a
second export registers v2, which does not beat v1 and is not promoted."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import BASE, BIN, stages_here, write_params
from hub_server import Hub

from flows.cli import main

CHAMPION = "models:/finetune-default@champion"


@pytest.fixture(scope="module")
def registered(tokenized, tmp_path_factory) -> Path:
    """A project whose registry holds v1 (promoted, champion) and v2 (not promoted)."""
    project = tmp_path_factory.mktemp("publish") / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    write_params(project, {**BASE, "eval.max_generation_samples": 2})
    stages_here(project, "train", "evaluate", "export", "export")
    versions = json.loads((project / "data/lineage/model_version.json").read_text())
    assert versions["version"] == "2" and not versions["promoted"], versions
    return project


def publish(project: Path, capsys, *args: str) -> tuple[int, str, str]:
    """`finetune publish ...` through the CLI's own main(), in this process."""
    capsys.readouterr()  # what came before is not its output
    code = main(["publish", *args, "-p", str(project / "params/default.yaml")])
    out = capsys.readouterr()
    return code, out.out, out.err


def files(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_champion_goes_to_a_hub_repo_once_and_an_unpromoted_version_is_refused(registered,
                                                                                    capsys):
    export = files(registered / "data/export")
    with Hub(token="hf_secret") as hub:
        env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url,
               "HF_TOKEN": "hf_secret",
               # the test Hub speaks LFS, not Xet (hf_xet, installed, is used where offered)
               "HF_HUB_DISABLE_XET": "1"}

        def cli(*args):
            return subprocess.run([str(BIN / "finetune"), "publish", *args], cwd=registered,
                                  capture_output=True, text=True, env=env)

        first = cli(CHAMPION, "--to", "hf://team/tiny-gsm8k")
        assert first.returncode == 0, first.stderr
        assert hub.commits == {"team/tiny-gsm8k": 1}
        uploaded = hub.repos["team/tiny-gsm8k"]
        assert sorted(uploaded) == sorted(export)  # the export's files, its README replaced
        for rel, sha in export.items():
            if rel != "README.md":
                assert hashlib.sha256(hub.file("team/tiny-gsm8k", rel)).hexdigest() == sha, rel
        assert "lfs" in uploaded["model.safetensors"] and "lfs" not in uploaded["config.json"]
        card = hub.file("team/tiny-gsm8k", "README.md").decode()
        run = json.loads((registered / "data/lineage/model_version.json").read_text())
        lineage = _lineage(registered)
        # the export card's Hub metadata stays first, less a base_model that is a local folder
        assert card.startswith("---\nlibrary_name: transformers\n")
        assert "base_model:" not in card.split("\n---\n")[0]
        # v2's export logged its decision to the same run after v1's: the tag says v1's
        assert "## Gate decision\n\npromoted (the version's gate.decision tag" in card
        assert "does not beat" not in card
        for fact in ("# finetune-default v1",
                     lineage["config_fingerprint"], lineage["data_sha256"],
                     lineage["git_commit"], export["model.safetensors"]):
            assert fact in card, fact
        assert run["model_uri"] == "models:/finetune-default/2"

        second = cli(CHAMPION, "--to", "hf:team/tiny-gsm8k")
        assert second.returncode == 0, second.stderr
        assert "nothing to upload" in second.stdout
        assert hub.commits == {"team/tiny-gsm8k": 1}  # no second commit

        # refused before the destination is touched (the CLI's main, in this process)
        code, out, err = publish(registered, capsys, "models:/finetune-default/2", "--to",
                                 "hf://team/tiny-gsm8k")
        assert code == 2 and err.strip().splitlines() == [
            "error: models:/finetune-default/2: the gate did not promote this version "
            "(gate.decision: not promoted); publish the champion, or pass --force"]
        assert hub.commits == {"team/tiny-gsm8k": 1}

        env["HF_TOKEN"] = "hf_wrong"
        denied = cli(CHAMPION, "--to", "hf://team/other")
        assert denied.returncode == 2 and "team/other" not in hub.repos
        assert len(denied.stderr.strip().splitlines()) == 1, denied.stderr
        assert "401" in denied.stderr, denied.stderr


def _lineage(project: Path) -> dict:
    from finetune.workspace import Workspace
    from tasks import tracking

    ws = Workspace.load(project / "params/default.yaml")
    return tracking.run_lineage(ws, tracking.run_id_of(ws))


def test_a_folder_and_an_fsspec_url_get_the_same_bytes_once(registered, tmp_path, capsys):
    dest = tmp_path / "published"
    code, out, err = publish(registered, capsys, CHAMPION, "--to", str(dest))
    assert code == 0, err
    export = files(registered / "data/export")
    published = files(dest)
    assert sorted(published) == sorted(export)
    assert {k: v for k, v in published.items() if k != "README.md"} == \
        {k: v for k, v in export.items() if k != "README.md"}
    stamps = {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()}

    code, out, err = publish(registered, capsys, CHAMPION, "--to", str(dest))
    assert code == 0 and "nothing to upload" in out, (out, err)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing rewritten

    (dest / "config.json").write_text("{}")  # changed there: only that file goes again
    code, out, err = publish(registered, capsys, CHAMPION, "--to", dest.as_uri())
    assert code == 0, err
    assert "uploaded 1 of" in out and "config.json" in out, out
    assert files(dest) == published

    import fsspec

    code, out, err = publish(registered, capsys, CHAMPION, "--to", "memory://bucket/model")
    assert code == 0, err
    memory = fsspec.filesystem("memory")
    assert memory.cat("/bucket/model/model.safetensors") == \
        (registered / "data/export/model.safetensors").read_bytes()


def test_bad_input_is_one_line_and_writes_nothing(registered, tmp_path, capsys):
    dest = tmp_path / "d"
    cases = {
        ("models:/finetune-default/2",): "the gate did not promote this version",
        ("models:/finetune-default/7",): "MODEL_URI 'models:/finetune-default/7': not in the "
                                         "model registry",
        ("models:/nope@champion",): "MODEL_URI 'models:/nope@champion': not in the model "
                                    "registry",
        ("finetune-default",): "MODEL_URI 'finetune-default': expected models:/NAME@ALIAS",
    }
    for args, said in cases.items():
        code, out, err = publish(registered, capsys, *args, "--to", str(dest))
        assert code == 2 and len(err.strip().splitlines()) == 1 and said in err, (args, err)
        assert not dest.exists()
    try:
        import s3fs  # noqa: F401
    except ImportError:
        code, out, err = publish(registered, capsys, CHAMPION, "--to", "s3://bucket/model")
        assert code == 2 and "pip install s3fs" in err and len(err.strip().splitlines()) == 1

    code, out, err = publish(registered, capsys, "models:/finetune-default/2", "--to",
                             str(dest), "--force")
    assert code == 0, err
    assert out.splitlines()[0] == (
        "warning: publishing models:/finetune-default/2 although the gate did not promote it "
        "(gate.decision: not promoted; --force)")
    card = (dest / "README.md").read_text()
    assert "# finetune-default v2" in card and "with --force" in card
    assert "not promoted: eval.loss" in card, card[:800]


def test_without_its_export_folder_a_version_comes_from_the_mlflow_store(registered, tmp_path,
                                                                         capsys):
    from safetensors.torch import load_file

    project = tmp_path / "p"
    shutil.copytree(registered, project, symlinks=True)
    export = project / "data/export"
    (export / "model.safetensors").write_bytes(b"not these weights")  # another run's export
    dest = tmp_path / "d"
    code, out, err = publish(project, capsys, CHAMPION, "--to", str(dest))
    assert code == 0, err
    assert "from data/registered/v1/finetune-default (from the MLflow store)" in out, out
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files(dest))
    ours = load_file(registered / "data/export/model.safetensors")
    theirs = load_file(dest / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all((ours[k] == theirs[k]).all() for k in ours)  # the same weights, MLflow's bytes
