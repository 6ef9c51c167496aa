"""Distillation through the pipeline: the teacher stage (tasks/teacher.py) and the distill
run. A run that is not offline distillation gets a teacher stage that loads nothing; the
offline stage writes the teacher's top-k at every trained token of every train row; a run
over those columns with top_k the vocabulary size takes the same first step (loss) as the
on-policy run with lmbda 0 (the teacher scoring the same rows in training, full vocabulary):
two paths to one number. A teacher whose tokenizer is not the student's is refused in one line
naming both; the on-policy run (lmbda 1: the student's samples) is seeded, so two runs are
the same bitwise and a run resumed from its checkpoint ends where an uninterrupted one does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from finetune.errors import PipelineError
from tests.helpers import (
    adapter,
    losses,
    stages_here,
    train_here,
    write_params,
)

STUDENT = "data/models/stories260K"
TEACHER = "data/models/teacher"


def make_teacher(project: Path, noise: float = 0.05) -> Path:
    """The shipped tiny model with seeded noise on every weight, saved with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(project / STUDENT), dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    out = project / TEACHER
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(project / STUDENT)).save_pretrained(out)
    return out


BASE = {"training.type": "distill", "distill.teacher": TEACHER, "training.max_steps": 2,
        "logging.logging_steps": 1, "eval.eval_strategy": "no",
        "checkpoint.save_strategy": "no", "training.per_device_train_batch_size": 2}


@pytest.fixture(scope="module")
def scored(tokenized, tmp_path_factory):
    """The tokenized project with a teacher and the offline stage run (top_k = vocabulary)."""
    project = tmp_path_factory.mktemp("distill") / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    make_teacher(project)
    write_params(project, {**BASE, "distill.top_k": 512})
    stages_here(project, "teacher")
    return project


def test_not_a_distill_run_loads_no_teacher(tokenized, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(tokenized, project, symlinks=True)
    stages_here(project, "teacher")
    manifest = json.loads((project / "data/teacher/teacher.json").read_text())
    assert manifest == {"scored": False, "why": "not a distillation run"}
    assert sorted(p.name for p in (project / "data/teacher").iterdir()) == ["teacher.json"]


def test_offline_stage_scores_every_trained_token(scored):
    import datasets

    cols = datasets.load_from_disk(str(scored / "data/teacher/train"))
    rows = datasets.load_from_disk(str(scored / "data/tokenized/train"))
    assert len(cols) == len(rows)
    for i in (0, len(rows) - 1):
        labels = torch.tensor(rows[i]["labels"])
        trained = int((labels[1:] != -100).sum())
        assert trained > 0
        assert len(cols[i]["teacher_ids"]) == trained * 512
        logps = torch.tensor(cols[i]["teacher_logps"]).reshape(trained, 512)
        # the whole vocabulary, most likely first: each row's probabilities sum to 1
        torch.testing.assert_close(logps.exp().sum(-1), torch.ones(trained), atol=1e-4,
                                   rtol=0)
        assert bool((logps[:, :-1] >= logps[:, 1:]).all())


def test_offline_columns_and_on_policy_teacher_take_the_same_step(scored, tmp_path):
    """top_k = vocabulary offline and lmbda 0 on-policy: the same loss at step 1 and 2, and
    the same adapter after them."""
    offline, _ = train_here(scored, tmp_path / "offline", {**BASE, "distill.top_k": 512})
    online, _ = train_here(scored, tmp_path / "online",
                           {**BASE, "distill.mode": "on_policy", "distill.lmbda": 0.0})
    a, b = losses(offline), losses(online)
    assert len(a) == 2 and a[0] > 1e-4 and a[1] < a[0]  # a divergence that shrinks
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    for (k, x), (_, y) in zip(sorted(adapter(offline).items()),
                              sorted(adapter(online).items())):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=k)
    # the evaluate stage: the teacher's held-out loss and the top-1 agreement, base and tuned
    write_params(offline, {**BASE, "distill.top_k": 512, "eval.generation_metrics": [],
                           "eval.contamination_ngram": None})
    stages_here(offline, "evaluate")
    ev = json.loads((offline / "data/metrics/eval.json").read_text())
    base, tuned = ev["base"], ev["finetuned"]
    assert base["teacher_loss"] == tuned["teacher_loss"] > 0
    # a teacher that is the base with noise agrees with it on most tokens, not all
    assert 0.3 < base["teacher_agreement"] < 1
    assert 0.3 < tuned["teacher_agreement"] < 1


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(scored, tmp_path, bpe_tok):
    project = tmp_path / "p"
    shutil.copytree(scored, project, symlinks=True)
    other = project / "data/models/other"
    shutil.copytree(project / TEACHER, other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    bpe_tok.save_pretrained(other)
    write_params(project, {**BASE, "distill.teacher": "data/models/other"})
    before = sorted(p.name for p in (project / "data/teacher").iterdir())
    with pytest.raises(PipelineError) as err:
        stages_here(project, "teacher")
    line = str(err.value)
    assert "\n" not in line
    assert "data/models/other" in line and STUDENT in line, line
    # nothing written is lost: the previous columns are in place
    assert sorted(p.name for p in (project / "data/teacher").iterdir()) == before


@pytest.mark.parametrize("teacher, says", [
    ("data/models/nope", "distill.teacher: teacher folder data/models/nope not found"),
    ("data/source", "distill.teacher: data/source has no config.json"),
])
def test_validate_refuses_a_teacher_folder_that_is_not_one(scored, teacher, says):
    from finetune.workspace import Workspace
    from tasks.checks import check_model_refs

    write_params(scored, {**BASE, "distill.teacher": teacher})
    try:
        with pytest.raises(PipelineError, match=says) as err:
            check_model_refs(Workspace.load(scored / "params/default.yaml"))
        assert "\n" not in str(err.value)
    finally:
        write_params(scored, {**BASE, "distill.top_k": 512})


def test_the_train_stage_refuses_columns_of_another_teacher_or_top_k(scored, tmp_path):
    from finetune.workspace import Workspace
    from tasks.launch import run_paths

    project = tmp_path / "p"
    shutil.copytree(scored, project, symlinks=True)
    write_params(project, {**BASE, "distill.top_k": 512})
    assert run_paths(Workspace.load(project / "params/default.yaml")).method_columns == (
        project / "data/teacher/train")
    write_params(project, {**BASE, "distill.top_k": 16})
    with pytest.raises(PipelineError, match="scored another top_k"):
        run_paths(Workspace.load(project / "params/default.yaml"))
    write_params(project, {**BASE, "distill.top_k": 512})
    with (project / TEACHER / "config.json").open("a") as fh:  # the folder changed
        fh.write("\n")
    with pytest.raises(PipelineError, match="scored another teacher_sha256"):
        run_paths(Workspace.load(project / "params/default.yaml"))


@pytest.mark.slow
def test_on_policy_runs_are_seeded_and_resume_bitwise(scored, tmp_path):
    """lmbda 1: every step trains on the student's own samples; two runs are the same
    bitwise, and one cut back to its step-2 checkpoint and resumed ends as the whole run
    (resume_from_checkpoint_in_process asserts the weights and losses)."""
    from tests.helpers import resume_from_checkpoint_in_process

    params = {**BASE, "distill.mode": "on_policy", "distill.lmbda": 1.0,
              "distill.max_new_tokens": 8, "training.max_steps": 4,
              "checkpoint.save_strategy": "steps", "checkpoint.save_steps": 2}
    resume_from_checkpoint_in_process(scored, tmp_path, params, at=2)
    again, _ = train_here(scored, tmp_path / "again", params)
    full = tmp_path / "full"
    assert losses(again) == losses(full) and len(losses(full)) == 4
    a, b = adapter(again), adapter(full)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the student's samples, not the data's completions: another loss than lmbda 0's
    data_run, _ = train_here(scored, tmp_path / "data",
                             {**params, "distill.lmbda": 0.0, "training.max_steps": 1,
                              "checkpoint.save_strategy": "no"})
    assert abs(losses(data_run)[0] - losses(full)[0]) > 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["offline", "on_policy"])
def test_two_processes_equal_one(scored, tmp_path, mode):
    """DDP on 2 torchrun processes x 2 rows equals one process x 2 micro-batches of 2: the
    offline columns follow their rows to whichever rank holds them; on-policy (lmbda 1) each
    prompt's samples are seeded by the step and its split row, not by the rank."""
    from tests.helpers import assert_weights_close, train_copy_here

    params = {**BASE, "distill.top_k": 512, "distill.mode": mode, "distill.lmbda": 1.0,
              "distill.max_new_tokens": 8}
    one, _ = train_here(scored, tmp_path / "one",
                        {**params, "training.gradient_accumulation_steps": 2})
    two, _ = train_copy_here(scored, tmp_path / "two", {
        **params, "distributed.strategy": "ddp", "distributed.nproc_per_node": 2,
        "training.gradient_accumulation_steps": 1})
    assert_weights_close(adapter(two), adapter(one))
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)


@pytest.mark.slow
def test_dvc_reruns_the_teacher_stage_only_when_its_inputs_change(tmp_path):
    """Under `dvc repro`: a student run with another beta, alpha or learning rate finds the
    teacher stage up to date (it reuses the columns); another top_k or teacher does not."""
    import subprocess

    from tests.helpers import BIN, copy_project

    project = copy_project(tmp_path / "p")
    make_teacher(project)
    write_params(project, {**BASE, "distill.top_k": 8})
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", "teacher"]):
        subprocess.run(cmd, cwd=project, check=True, capture_output=True)

    def dvc(*args):
        return subprocess.run([str(BIN / "dvc"), *args], cwd=project, capture_output=True,
                              text=True, check=True).stdout

    dvc("repro", "teacher")
    assert json.loads((project / "data/teacher/teacher.json").read_text())["scored"]
    for change in ({"distill.beta": 0.0}, {"distill.alpha": 0.5},
                   {"optimizer.learning_rate": 0.001}):
        write_params(project, {**BASE, "distill.top_k": 8, **change})
        assert "teacher" not in dvc("status", "teacher"), change
    write_params(project, {**BASE, "distill.top_k": 16})
    assert "distill.top_k" in dvc("status", "teacher")
