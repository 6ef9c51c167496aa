"""End to end: a real Prefect server on loopback, the project's own deployment definition,
`prefect deployment run finetune/default --watch`, the nightly schedule, and a clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from helpers import BIN, copy_project
from flows.stack import group_alive


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
def test_stack_deployment_run_schedule_and_clean_stop(tmp_path):
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
    try:
        deployment = wait_for(lambda: api(url, "/deployments/name/finetune/default"), 150,
                              "deployment finetune/default")
        schedules = [s["schedule"] for s in deployment["schedules"]]
        assert {"cron": "0 2 * * *", "timezone": "UTC"}.items() <= schedules[0].items()

        run_env = {**env, "PREFECT_API_URL": url}
        proc = subprocess.run([str(BIN / "prefect"), "deployment", "run", "finetune/default",
                               "--watch", "--watch-timeout", "400"],
                              cwd=project, env=run_env, capture_output=True, text=True, timeout=450)
        assert proc.returncode == 0, proc.stdout + proc.stderr + (tmp_path / "stack.log").read_text()
        assert "Completed" in proc.stdout

        run_file = project / "data/lineage/train_run.json"
        run_id = json.loads(run_file.read_text())["mlflow_run_id"]
        from mlflow.tracking import MlflowClient

        run = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}").get_run(run_id)
        assert run.info.status == "FINISHED" and "eval.loss" in run.data.metrics

        scheduled = wait_for(lambda: api(url, "/flow_runs/filter", {
            "deployments": {"id": {"any_": [deployment["id"]]}},
            "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}}), 60, "scheduled runs")
        for run in scheduled:
            start = run["next_scheduled_start_time"] or run["expected_start_time"]
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
    import re

    text = (tmp_path / "stack.log").read_text()
    children = [int(p) for p in re.findall(r"pid (\d+)\)", text)]
    assert len(children) == 2, text  # the server and the serve process, each its own group
    assert [p for p in children if group_alive(p)] == [], "processes left behind"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "server still listening"
