"""The console script: subcommands and the one-line error contract."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import BIN, ROOT, error_line, run_cli


def test_validate_and_config_print_resolved_values():
    ok = run_cli(ROOT, "validate")
    assert ok.returncode == 0 and "is valid" in ok.stdout
    shown = run_cli(ROOT, "config", "-s", "training.max_steps=3")
    assert shown.returncode == 0
    assert "max_steps: 3" in shown.stdout and "auto_class_name: AutoModelForCausalLM" in shown.stdout


def test_unknown_key_via_override_is_one_line():
    line = error_line(run_cli(ROOT, "validate", "-s", "training.lerning_rate=1"))
    assert "unknown key 'training.lerning_rate'" in line


def test_debug_shows_traceback():
    proc = run_cli(ROOT, "--debug", "validate", "-s", "training.max_steps=x")
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_help_lists_stages():
    proc = subprocess.run([str(BIN / "finetune"), "stage", "--help"], capture_output=True, text=True)
    for stage in ("download", "format", "tokenize", "train", "evaluate", "export"):
        assert stage in proc.stdout


def _analytics_daemons() -> list[int]:
    """Pids of DVC's detached usage-analytics senders (`dvc daemon ... analytics FILE`)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"daemon" in argv and b"analytics" in argv:
            found.append(int(proc.name))
    return found


@pytest.mark.slow  # the pipeline through `dvc repro` up to a training step: make test-slow
def test_a_killed_dvc_repro_leaves_no_analytics_process(project, tmp_path):
    """DVC sends usage analytics from a detached daemon it spawns as a command ends, Ctrl-C
    included (offline, that daemon lingers). In a clone of the project, with none of our
    environment set, a `dvc repro` interrupted mid-stage spawns none: no daemon process, and
    nothing written to the log file DVC would give it."""
    import os
    import signal
    import time

    log = tmp_path / "dvc-daemon.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("DVC_NO_ANALYTICS", "DVC_TEST", "DO_NOT_TRACK", "DVC_DAEMON")}
    env["DVC_DAEMON_LOGFILE"] = str(log)
    # each line as it is written: block-buffered into the pipe, "Running stage" could arrive
    # only as dvc exits, and the Ctrl-C would land on a finished repro
    env["PYTHONUNBUFFERED"] = "1"
    before = set(_analytics_daemons())
    repro = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=project, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    for line in repro.stdout:  # mid-stage: training has logged a step (a short stage such as
        if line.startswith("[train] step="):  # validate can finish before the signal lands)
            break
    os.killpg(repro.pid, signal.SIGINT)
    out = repro.communicate(timeout=60)[0]
    assert repro.returncode != 0, out
    time.sleep(2)  # a daemon is spawned as dvc exits
    assert set(_analytics_daemons()) - before == set()
    assert not log.exists(), log.read_text()


def test_dvc_sends_no_usage_analytics_from_the_project():
    """DVC ignores DO_NOT_TRACK; the project's .dvc/config turns its analytics off for every
    dvc command run in a clone (asked of DVC itself, with none of our environment set), and
    the CLI sets DVC_NO_ANALYTICS for the dvc it starts."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("DVC_NO_ANALYTICS", "DVC_TEST", "DO_NOT_TRACK")}
    proc = subprocess.run([sys.executable, "-c", "from dvc.analytics import is_enabled; "
                           "print(is_enabled())"], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True)
    assert proc.stdout.strip() == "False"
    from flows.cli import _quiet_env

    saved = os.environ.pop("DVC_NO_ANALYTICS", None)
    try:
        _quiet_env()
        assert os.environ["DVC_NO_ANALYTICS"] == "1"
    finally:
        os.environ.pop("DVC_NO_ANALYTICS", None)
        if saved is not None:
            os.environ["DVC_NO_ANALYTICS"] = saved
