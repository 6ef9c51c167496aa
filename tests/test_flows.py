"""Prefect flow and tasks against a real (temporary) Prefect server: prefect_test_harness."""

from __future__ import annotations

import importlib.metadata as md
import subprocess

import pytest
import yaml
from packaging.version import Version
from prefect.states import State

from helpers import BIN, ROOT, copy_project
from finetune.workspace import workspace_lock


def test_version_traps_pinned():
    """prefect 3.8.8 breaks at runtime on fastapi >= 0.151 and SQLAlchemy >= 2.1 (cron runs)."""
    assert Version(md.version("fastapi")) < Version("0.151")
    assert Version(md.version("sqlalchemy")) < Version("2.1")


def test_prefect_yaml_matches_deployment_settings():
    from flows.deploy import load_settings

    s = load_settings(ROOT / "params/deployment.yaml")
    dep = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][0]
    assert dep["name"] == s.name == "default"
    assert dep["schedules"][0] == {"cron": s.cron, "timezone": s.timezone}
    assert dep["entrypoint"] == "flows/finetune.py:finetune"


def test_tasks_via_fn_run_then_report_cached(tmp_path):
    from flows.finetune import download

    project = copy_project(tmp_path / "p")
    first = download.fn(str(project))
    assert first == {"stage": "download", "ran": True}
    second = download.fn(str(project))
    assert isinstance(second, State) and second.message == "cached: up to date"


def test_retry_conditions():
    from prefect.states import Failed

    from flows.finetune import retry_if_transient, retry_unless_bad_input
    from flows.dvc_runner import StageFailed

    def failed(code):
        return Failed(data=StageFailed("x", code))

    assert retry_if_transient(None, None, failed(75))
    assert not retry_if_transient(None, None, failed(2))
    assert retry_unless_bad_input(None, None, failed(1))
    assert not retry_unless_bad_input(None, None, failed(2))


def test_the_retry_reads_the_exit_code_from_dvcs_real_output(tmp_path):
    """The code the retry predicates see is the one parsed from a real failing `dvc repro`'s
    output: bad input (exit 2) is not retried."""
    from prefect.states import Failed

    from flows.dvc_runner import StageFailed, repro_stage
    from flows.finetune import retry_if_transient, retry_unless_bad_input

    project = copy_project(tmp_path / "p", {"training.max_steps": -1,
                                            "training.num_train_epochs": 0})
    with pytest.raises(StageFailed) as failure:
        repro_stage(project, "validate")
    assert failure.value.stage_exit == 2, str(failure.value)
    state = Failed(data=failure.value)
    assert not retry_unless_bad_input(None, None, state)
    assert not retry_if_transient(None, None, state)


def dvc_status(project) -> str:
    return subprocess.run([str(BIN / "dvc"), "status"], cwd=project, capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def flow_project(tmp_path_factory, harness):
    return copy_project(tmp_path_factory.mktemp("flow") / "p")


def test_flow_failures_surface_the_stage_message(flow_project):
    """A bad override fails before anything runs; one that validate refuses fails inside the
    override session, which puts the params file back byte for byte. (Full runs, cached runs
    and runs with overrides through the deployment: tests/test_e2e_prefect.py.)"""
    from flows.finetune import finetune

    params = (flow_project / "params/default.yaml").read_bytes()
    status = dvc_status(flow_project)
    bad = finetune(workspace=str(flow_project), overrides={"training.max_steps": -1, "training.num_train_epochs": 0},
                   return_state=True)
    assert bad.is_failed()
    with pytest.raises(Exception, match="max_steps > 0 or num_train_epochs > 0"):
        bad.result()
    missing = finetune(workspace=str(flow_project),
                       overrides={"data.data_files": {"train": "data/source/nope.jsonl"}},
                       return_state=True)
    assert missing.is_failed()
    with pytest.raises(Exception, match="stage 'validate' failed: data file .*nope.jsonl not found"):
        missing.result()
    assert (flow_project / "params/default.yaml").read_bytes() == params
    assert dvc_status(flow_project) == status


def test_second_run_waits_or_fails_on_workspace_lock(flow_project):
    from flows.finetune import finetune

    with workspace_lock(flow_project):
        busy = finetune(workspace=str(flow_project), return_state=True)
    assert busy.is_failed()
    with pytest.raises(Exception, match="is busy: another pipeline run holds"):
        busy.result()
