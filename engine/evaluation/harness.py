"""lm-evaluation-harness tasks on a loaded model: the one implementation the evaluate stage
(tasks.harness, `eval.harness`) and in-training evaluation (engine.recipe.sft.in_training,
`eval.during_training_metrics` naming `harness.<task>.<metric>.<filter>`) both run.

The tasks run through lm-eval's own Python API (`simple_evaluate`) on the model already in
memory, wrapped in lm-eval's HF backend (`HFLM`, which takes a model instance as one process's
whole model: world size 1): the harness's prompts, few-shot sampling, generation settings,
filters and metrics are its own. A task is a name lm-eval knows or a task YAML in the project
(or a folder of them). Results are flattened as `harness.<task>.<metric>.<filter>` (and lm-eval's
`harness.<task>.<metric>_stderr.<filter>`). lm-eval seeds Python's, NumPy's and torch's
generators at every call; their states are restored afterwards, so a run that evaluates a task
mid-training draws the same random numbers as one that does not.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

from finetune.config.section import did_you_mean
from finetune.errors import PipelineError

INSTALL = ("eval.harness.tasks needs lm-evaluation-harness, which is not installed: "
           "pip install 'finetune-pipeline[harness]' (lm-eval==0.4.13), or set "
           "eval.harness.tasks: []")


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise PipelineError(INSTALL) from None


def resolve_tasks(tasks: list[str], root: Path):
    """(task names, lm-eval TaskManager) for `eval.harness.tasks`: a YAML file's task is its
    `task:` name and its folder joins the manager's include path; a folder adds every task in
    it. A missing file or an unknown name is one line naming the key; so is lm-eval missing.
    Project task files alone are indexed without lm-eval's own tasks (the same task configs;
    indexing those costs seconds at every call)."""
    require_lm_eval()
    import yaml
    from lm_eval.tasks import TaskManager

    names, folders, specs, named = [], [], [], False
    for entry in tasks:
        path = Path(entry) if Path(entry).is_absolute() else root / entry
        looks_like_a_path = entry.endswith((".yaml", ".yml")) or "/" in entry
        if path.is_file():
            spec = yaml.safe_load(path.read_text()) or {}
            if not isinstance(spec, dict) or "task" not in spec:
                raise PipelineError(f"eval.harness.tasks: {entry} has no 'task:' name (an "
                                    "lm-eval task YAML names its task)")
            names.append(str(spec["task"]))
            folders.append(str(path.parent))
            specs.append(spec)
        elif path.is_dir():
            found = sorted(path.glob("*.yaml"))
            if not found:
                raise PipelineError(f"eval.harness.tasks: folder {entry} holds no task YAML")
            folders.append(str(path))
            for f in found:
                spec = yaml.safe_load(f.read_text()) or {}
                names.append(str(spec.get("task", f.stem)))
                specs.append(spec)
        elif looks_like_a_path:
            raise PipelineError(f"eval.harness.tasks: task file {entry} not found ({path})")
        else:
            names.append(entry)
            named = True
    # lm-eval's own task index (thousands of YAML files, ~6 s of CPU) only where a task may
    # need it: a task named, or a project YAML that groups or tags tasks (by name)
    defaults = named or any(not isinstance(spec, dict) or not isinstance(spec.get("task"), str)
                            or {"group", "tag", "task_list"} & set(spec) for spec in specs)
    with quiet():
        manager = TaskManager(include_path=list(dict.fromkeys(folders)) or None,
                              include_defaults=defaults)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            raise PipelineError(f"eval.harness.tasks: unknown task '{name}'"
                                f"{did_you_mean(name, sorted(known))}: an lm-eval "
                                "task name, or a task YAML file or folder in the project")
    return names, manager


def run_tasks(model, tok, root: Path, names: list[str], manager, *, batch_size: int,
              num_fewshot: int | None, limit: int | None, apply_chat_template: bool = False,
              max_gen_toks: int | None = None) -> dict[str, Any]:
    """lm-eval's results (JSON-able) for `names` on one loaded transformers model (a PEFT
    wrapper's base model, the adapter's layers inside), with the project root as the working
    folder (where the local tasks' data_files are). The model is left in the mode it was in
    (HFLM switches it to eval), and the random generators in the states they were in."""
    import numpy as np
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    was_training = model.training
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with quiet(), contextlib.chdir(root), torch.random.fork_rng(devices=devices), \
                torch.no_grad():
            lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size,
                      device=str(next(model.parameters()).device))
            results = simple_evaluate(
                model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit,
                apply_chat_template=apply_chat_template, task_manager=manager,
                gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None,
                log_samples=False, bootstrap_iters=1000)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        model.train(was_training)
    return _jsonable(results)


def flatten(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's per-task `{"metric,filter": value}` as `harness.<task>.<metric>.<filter>`."""
    flat = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            flat[f"harness.{task}.{metric}.{filt}"] = float(value)
    return flat


def stderr_name(name: str) -> str:
    """`harness.<task>.<metric>.<filter>`'s stderr as flatten spells it
    (`harness.<task>.<metric>_stderr.<filter>`)."""
    head, metric, filt = name.rsplit(".", 2)
    return f"{head}.{metric}_stderr.{filt}"


def higher_is_better(results: dict[str, Any], name: str) -> bool | None:
    """lm-eval's own direction for `harness.<task>.<metric>.<filter>` (its results'
    `higher_is_better`), None where it does not say."""
    _, task, rest = name.split(".", 2)
    metric = rest.rsplit(".", 1)[0]
    value = (results.get("higher_is_better") or {}).get(task, {}).get(metric)
    return value if isinstance(value, bool) else None


def _jsonable(value):
    import json

    return json.loads(json.dumps(value, default=str))


@contextlib.contextmanager
def quiet():
    """lm-eval logs each step at INFO/WARNING; the stage's own lines are what a user reads."""
    import logging

    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
