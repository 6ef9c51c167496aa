"""End to end: a real Prefect server on loopback, the project's own deployment definition,
`prefect deployment run finetune/default --watch` (a full run, a cached one, one with
overrides), the nightly schedule, and a clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from helpers import BIN, copy_project
from flows.stack import group_alive

STAGES = ["download", "format", "tokenize", "teacher", "train", "evaluate", "export"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(f"{url}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.stack_e2e
def test_stack_deployment_run_schedule_and_clean_stop(tmp_path):
    """The README's commands against the real stack: a full run, a second run that finds
    everything cached, a run with `--param overrides=...` (a DVC experiment that leaves the
    params file and the baseline outputs as they were), the nightly schedule, a clean stop."""
    project = copy_project(tmp_path / "p")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), FINETUNE_ROOT=str(project),
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5",
               PREFECT_RUNNER_POLL_FREQUENCY="2")  # the serve process picks the run up sooner
    log = open(tmp_path / "stack.log", "w")
    stack = subprocess.Popen([str(BIN / "finetune-stack"), "--port", str(port)], cwd=project,
                             env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def deployment_run(*args: str) -> dict:
        """`prefect deployment run finetune/default ARGS --watch`; the finished flow run."""
        proc = subprocess.run([str(BIN / "prefect"), "deployment", "run", "finetune/default",
                               *args, "--watch", "--watch-timeout", "400"],
                              cwd=project, env={**env, "PREFECT_API_URL": url},
                              capture_output=True, text=True, timeout=450)
        assert proc.returncode == 0, proc.stdout + proc.stderr + (
            tmp_path / "stack.log").read_text()
        flow_run = api(url, f"/flow_runs/{re.search(r'UUID: ([0-9a-f-]{36})', proc.stdout)[1]}")
        assert flow_run["state"]["type"] == "COMPLETED", flow_run["state"]
        return flow_run

    def task_messages(flow_run: dict) -> dict[str, str]:
        runs = api(url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
        return {r["name"].rsplit("-", 1)[0]: r["state"]["message"] or "" for r in runs}

    def summary(flow_run: dict) -> str:
        artifacts = api(url, "/artifacts/filter", {"artifacts": {
            "key": {"any_": ["finetune-summary"]}, "flow_run_id": {"any_": [flow_run["id"]]}}})
        assert len(artifacts) == 1, artifacts
        return artifacts[0]["data"]

    try:
        deployment = wait_for(lambda: api(url, "/deployments/name/finetune/default"), 150,
                              "deployment finetune/default")
        schedules = [s["schedule"] for s in deployment["schedules"]]
        assert {"cron": "0 2 * * *", "timezone": "UTC"}.items() <= schedules[0].items()

        first = deployment_run()
        assert set(task_messages(first)) == {"validate", *STAGES}
        assert "cached" not in "".join(task_messages(first).values())
        text = summary(first)
        assert "| fine-tuned |" in text and "exact_match" in text
        assert "fine-tuning improved eval loss" in text
        assert "registered model: finetune-default v1 (candidate + champion)" in text
        assert f"stages ran: {', '.join(STAGES)}; cached: none" in text
        run_id = json.loads((project / "data/lineage/train_run.json").read_text())["mlflow_run_id"]
        from mlflow.tracking import MlflowClient

        run = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}").get_run(run_id)
        assert run.info.status == "FINISHED" and "eval.loss" in run.data.metrics

        again = deployment_run()
        assert again["state"]["message"].startswith("up to date"), again["state"]
        messages = task_messages(again)
        assert set(messages) == {"validate", *STAGES}
        assert all(m == "cached: up to date" for m in messages.values()), messages

        params = (project / "params/default.yaml").read_bytes()
        tried = deployment_run("--param", 'overrides={"training.max_steps": 4}')
        text = summary(tried)
        assert "stages ran: train, evaluate, export; cached: download, format, tokenize" in text
        experiment = re.search(r"DVC experiment: (\S+)", text)[1]
        assert (project / "params/default.yaml").read_bytes() == params
        exps = subprocess.run([str(BIN / "dvc"), "exp", "show", "--json"], cwd=project,
                              capture_output=True, text=True, check=True).stdout
        assert experiment in exps
        status = subprocess.run([str(BIN / "dvc"), "status"], cwd=project,
                                capture_output=True, text=True, check=True).stdout
        assert "up to date" in status, status  # the baseline outputs are back in the workspace

        scheduled = wait_for(lambda: api(url, "/flow_runs/filter", {
            "deployments": {"id": {"any_": [deployment["id"]]}},
            "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}}), 60, "scheduled runs")
        for run in scheduled:
            # the schedule's slot; next_scheduled_start_time moves when a due run's submission
            # is retried (a test that runs across 02:00 UTC saw 02:01:03)
            start = run["expected_start_time"] or run["next_scheduled_start_time"]
            assert "T02:00:00" in start, start
    finally:
        stack.send_signal(signal.SIGINT)
        try:
            stack.wait(timeout=90)
        finally:
            if stack.poll() is None:
                os.killpg(stack.pid, signal.SIGKILL)
        log.close()
    assert stack.returncode == 0, (tmp_path / "stack.log").read_text()
    assert not group_alive(stack.pid)
    text = (tmp_path / "stack.log").read_text()
    children = [int(p) for p in re.findall(r"pid (\d+)\)", text)]
    assert len(children) == 2, text  # the server and the serve process, each its own group
    assert [p for p in children if group_alive(p)] == [], "processes left behind"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "server still listening"
