"""Shared fixtures: an isolated copy of the project (its own git repo, DVC, MLflow store), the
session's tokenized project, the offline environment; and the order test files run in.

The plain helpers these build on, and that test files import, are in tests/helpers.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import BIN, copy_project, run_cli

#: The longest files (by `--durations` on the 2-core dev CPU), run first: `make test` hands
#: whole files to the pytest-xdist workers in collection order (--dist loadfile
#: --no-loadscope-reorder), so no long file starts last and runs alone at the end.
LONGEST_FIRST = ("test_strategies.py", "test_e2e_prefect.py", "test_pipeline.py",
                 "test_training.py", "test_failures.py", "test_preference.py", "test_grpo.py",
                 "test_pipeline_parallel.py", "test_reliability.py", "test_launch.py",
                 "test_streaming.py", "test_harness.py", "test_run_control.py", "test_flows.py",
                 "test_mixture.py")


def pytest_collection_modifyitems(items):
    """Reorder files only (a stable sort keeps each file's own order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


@pytest.fixture(autouse=True, scope="session")
def _offline_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("caches")
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HOME": str(cache / "hf"),
        "DVC_SITE_CACHE_DIR": str(cache / "dvc-site"),
        "FINETUNE_CACHE_DIR": str(cache / "finetune"),
        "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.com",
        "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.com",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def project(tmp_path) -> Path:
    return copy_project(tmp_path / "proj")


@pytest.fixture(scope="session")
def tokenized(tmp_path_factory) -> Path:
    """A project with download/format/tokenize done once; tests copy it and train."""
    project = copy_project(tmp_path_factory.mktemp("tok") / "p", {"logging.logging_steps": 1})
    for name in ("download", "format", "tokenize"):
        run_cli(project, "stage", name, check=True)
    return project
