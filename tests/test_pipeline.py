"""`dvc repro` end to end on a copy of the project (its own git repo, DVC cache, MLflow store)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from conftest import BIN, copy_project, write_params

STAGES = ["download", "format", "tokenize", "train", "evaluate", "export"]


def dvc(project, *args, check=True):
    proc = subprocess.run([str(BIN / "dvc"), *args], cwd=project, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def ran(proc) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", proc.stdout)


@pytest.fixture(scope="module")
def repro(tmp_path_factory):
    project = copy_project(tmp_path_factory.mktemp("pipe") / "p")
    first = dvc(project, "repro")
    return project, first


def test_first_repro_runs_all_stages_and_finetuning_helps(repro):
    project, first = repro
    assert ran(first) == STAGES
    ev = json.loads((project / "data/metrics/eval.json").read_text())
    assert ev["finetuned"]["loss"] < ev["base"]["loss"]
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES)
    shown = dvc(project, "metrics", "show", "--json").stdout
    assert "finetuned" in shown


def test_exported_model_reloads_and_generates(repro):
    project, _ = repro
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = project / "data/export"
    assert (export / "model.safetensors").exists() and (export / "README.md").exists()
    assert not (export / "adapter_config.json").exists(), "export must be merged, not an adapter"
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok("Question: Tom has 3 apples and buys 2 more. How many?\nAnswer:", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    card = (export / "README.md").read_text()
    assert "sha256" in card and "| finetuned |" in card


def test_mlflow_run_has_lineage(repro):
    project, _ = repro
    from mlflow.tracking import MlflowClient

    run_id = json.loads((project / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
    run = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert len(tags["git_commit"]) == 40 and tags["data_sha256"]
    assert {"dvc_stage.download", "dvc_stage.tokenize", "dvc_stage.train"} <= set(tags)
    assert run.data.metrics["eval.loss"] < run.data.metrics["eval.base_loss"]


def out_hash(project, stage, path):
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    return next(o["md5"] for o in lock["stages"][stage]["outs"] if o["path"] == path)


def test_forced_retrain_reproduces_the_model_bit_for_bit(repro):
    project, _ = repro
    before = out_hash(project, "train", "data/trained")
    dvc(project, "repro", "--force", "--single-item", "train")
    assert out_hash(project, "train", "data/trained") == before
    status = dvc(project, "status").stdout
    assert "up to date" in status, status  # evaluate/export see identical weights: no rerun


def test_second_repro_is_noop_and_training_change_reruns_only_later_stages(repro):
    project, _ = repro
    again = dvc(project, "repro")
    assert ran(again) == [] and "up to date" in again.stdout
    write_params(project, {"training.max_steps": 4})
    changed = dvc(project, "repro")
    assert ran(changed) == ["train", "evaluate", "export"]
    assert json.loads((project / "data/metrics/train.json").read_text())["global_step"] == 4


def test_failing_repro_keeps_previous_outputs(repro):
    project, _ = repro
    export = project / "data/export/model.safetensors"
    weights = export.read_bytes()
    write_params(project, {"training.max_steps": 5, "optimizer.name": "NoSuchOpt"})
    failed = dvc(project, "repro", check=False)
    assert failed.returncode != 0
    assert "'NoSuchOpt' is not a torch.optim optimizer class" in failed.stdout + failed.stderr
    assert export.read_bytes() == weights
    assert (project / "data/trained/adapter_model.safetensors").exists()
    assert (project / "data/tokenized/train").exists()
