"""The `finetune` flow: the pipeline stages (six, and the teacher stage) as Prefect tasks, one
lineage with `dvc repro`.

Each task runs its DVC stage (`dvc repro --single-item`), whose command is the same stage
function `dvc repro` runs: unchanged stages are skipped by DVC and shown as
`Completed("cached: up to date")`; stages that ran are recorded in `dvc.lock`. Overrides are
validated first, run as a DVC experiment, and leave the params file as it was.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context
from prefect.states import Completed
from prefect.tasks import exponential_backoff

from finetune.errors import PipelineError
from finetune.workspace import (DEFAULT_PARAMS, Layout, Workspace, find_project_root,
                                workspace_lock)
from tasks import STAGES
from flows.dvc_runner import (OverrideSession, StageFailed, forget_lineage_of_restored,
                              repro_stage)
from flows.report import markdown, summary
from tasks.train import RESUME_ENV

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _logger():
    """The run logger inside Prefect; a plain logger when a task is called via `.fn`."""
    import logging

    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("finetune.flow")


def _run_count() -> int:
    from prefect.exceptions import MissingContextError

    try:
        return get_run_context().task_run.run_count
    except (MissingContextError, AttributeError):
        return 1


VALIDATE = "validate"  # dvc.yaml's guard stage: every step depends on its marker file


def _stage(stage: str, root: str, extra_env: dict[str, str] | None = None):
    logger = _logger()
    if stage != VALIDATE and not Layout(Path(root)).params_valid.exists():
        repro_stage(Path(root), VALIDATE, on_line=logger.info)  # a task run on its own
    result = repro_stage(Path(root), stage, on_line=logger.info, extra_env=extra_env)
    forget_lineage_of_restored(Path(root), result.output)
    if not result.ran:
        return Completed(message="cached: up to date", data={"stage": stage, "ran": False})
    return {"stage": stage, "ran": True}


def _failure(state) -> Exception | None:
    try:
        state.result()
    except Exception as exc:  # the task's exception is re-raised by result()
        return exc
    return None


def retry_if_transient(task, task_run, state) -> bool:
    """Network/hub failures are worth a retry; bad input (exit 2) never is."""
    exc = _failure(state)
    return isinstance(exc, StageFailed) and exc.transient


def retry_unless_bad_input(task, task_run, state) -> bool:
    """A crashed training (killed, OOM, lost node) is retried; a config error is not."""
    exc = _failure(state)
    return not (isinstance(exc, StageFailed) and exc.stage_exit == 2)


@task(name="download", retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5),
      retry_condition_fn=retry_if_transient)
def download(root: str):
    """Network sources fail transiently: retry with exponential backoff."""
    return _stage("download", root)


@task(name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_bad_input)
def train(root: str):
    """Retried once; the retry resumes from the latest checkpoint instead of starting over."""
    return _stage("train", root, {RESUME_ENV: "1"} if _run_count() > 1 else None)


def _plain_task(stage: str):
    """Stages with nothing to retry: a task that just runs the DVC stage."""

    def run(root: str):
        return _stage(stage, root)

    run.__name__ = run.__qualname__ = f"{stage}_stage"
    return task(name=stage)(run)


validate, format_prompts, tokenize, teacher, evaluate, export = map(
    _plain_task, (VALIDATE, "format", "tokenize", "teacher", "evaluate", "export"))
TASKS = {"download": download, "format": format_prompts, "tokenize": tokenize,
         "teacher": teacher, "train": train, "evaluate": evaluate, "export": export}
assert tuple(TASKS) == STAGES


def project_root(workspace: str | None) -> Path:
    return Path(workspace).resolve() if workspace else find_project_root(PROJECT_ROOT)


@flow(name="finetune", log_prints=True)
def finetune(params_file: str = DEFAULT_PARAMS,
             overrides: dict[str, Any] | list[str] | None = None,
             workspace: str | None = None, lock_wait_seconds: float = 0.0):
    """Run (or skip, when up to date) every stage of the pipeline in `workspace`.
    `overrides`: `-s` strings as `finetune -s` and `dvc exp run -S` take them
    (["training.max_steps=300", "+model.load_in_4bit=true"]), or dotted keys to values
    ({"training.max_steps": 300})."""
    root = project_root(workspace)
    params = (root / params_file).resolve()
    if params != (root / DEFAULT_PARAMS).resolve():
        raise PipelineError(f"the flow reproduces {DEFAULT_PARAMS} (what dvc.yaml tracks); "
                            f"pass overrides instead of params_file={params_file}")
    ws = Workspace.load(params, overrides or [])  # validate before anything runs
    experiment = None
    overriding = OverrideSession(root, params, overrides) if overrides else contextlib.nullcontext()
    with workspace_lock(root, lock_wait_seconds), overriding as session:
        validate(str(root))  # the whole params file, first, as `dvc repro` checks it
        results = {name: fn(str(root)) for name, fn in TASKS.items()}
        ran = [n for n, r in results.items() if isinstance(r, dict) and r.get("ran")]
        cached = [n for n in STAGES if n not in ran]
        if session:
            experiment = session.save_experiment(f"prefect-{time.strftime('%Y%m%d-%H%M%S')}")
        info = summary(ws)  # before the session restores the baseline metrics
    report = markdown(info, ran, cached, experiment)
    create_markdown_artifact(key="finetune-summary", markdown=report,
                             description="metrics, MLflow run, export path, stages ran/cached")
    result = {**info, "ran": ran, "cached": cached, "experiment": experiment}
    if not ran:
        return Completed(message="up to date: no data or params changed since the last run",
                         data=result)
    return result
