"""lm-evaluation-harness tasks in the evaluate stage (`eval.harness`).

The tasks run through lm-eval's own Python API (`simple_evaluate`) on the models the stage has
already loaded, wrapped in lm-eval's HF backend (`HFLM`): the harness's prompts, few-shot
sampling, generation settings, filters and metrics are its own, and nothing is loaded or
written twice. A task is a name lm-eval knows (its data comes from the hub) or a task YAML in
the project, or a folder of them (`data/harness/gsm8k_local.yaml`: GSM8K's official task on the
shipped rows, offline). Results land in eval.json under each model as
`harness.<task>.<metric>.<filter>` (and `..._stderr`), which the registry gate can name.

lm-eval is an optional extra (`pip install 'finetune-pipeline[harness]'`): without it a params
file that names harness tasks is refused with one line.
"""

from __future__ import annotations

import contextlib
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
    it. A missing file or an unknown name is one line naming the key; so is lm-eval missing."""
    require_lm_eval()
    import yaml
    from lm_eval.tasks import TaskManager

    names, folders = [], []
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
        elif path.is_dir():
            found = sorted(path.glob("*.yaml"))
            if not found:
                raise PipelineError(f"eval.harness.tasks: folder {entry} holds no task YAML")
            folders.append(str(path))
            names += [str((yaml.safe_load(f.read_text()) or {}).get("task", f.stem))
                      for f in found]
        elif looks_like_a_path:
            raise PipelineError(f"eval.harness.tasks: task file {entry} not found ({path})")
        else:
            names.append(entry)
    with _quiet():
        manager = TaskManager(include_path=list(dict.fromkeys(folders)) or None)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            raise PipelineError(f"eval.harness.tasks: unknown task '{name}'"
                                f"{did_you_mean(name, sorted(known))}: an lm-eval "
                                "task name, or a task YAML file or folder in the project")
    return names, manager


def chat_tokenizer(trained: Path):
    """apply_chat_template: the trained (and exported) tokenizer, which carries the template a
    chat dataset trained with; without one, one line."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(trained))
    if not getattr(tok, "chat_template", None):
        raise PipelineError(f"eval.harness.apply_chat_template: the trained tokenizer "
                            f"({trained}) has no chat template; train on a chat dataset (its "
                            "data.chat_template is saved with it) or set it to false")
    return tok


def run(harness, model, tok, root: Path, names: list[str], manager) -> tuple[dict, dict]:
    """The tasks on one loaded model: (flat metrics `harness.<task>.<metric>.<filter>`,
    lm-eval's full results). Runs with the project root as the working folder, where the
    local tasks' data_files are."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    with _quiet(), contextlib.chdir(root):
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=harness.batch_size,
                  device=str(next(model.parameters()).device))
        results = simple_evaluate(
            model=lm, tasks=names, num_fewshot=harness.num_fewshot, limit=harness.limit,
            apply_chat_template=harness.apply_chat_template, task_manager=manager,
            gen_kwargs={"max_gen_toks": harness.max_gen_toks} if harness.max_gen_toks else None,
            log_samples=False, bootstrap_iters=1000)
    return flatten(results["results"]), _jsonable(results)


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


def check_gate(gate_metric: str, finetuned: dict) -> None:
    """A harness gate metric the tasks did not report is one line listing those they did."""
    key = gate_metric.removeprefix("eval.")
    if key.startswith("harness.") and key not in finetuned:
        reported = sorted("eval." + k for k in finetuned if k.startswith("harness."))
        raise PipelineError(f"registry.gate_metric {gate_metric} is not a metric the harness "
                            f"tasks reported (they reported {', '.join(reported) or 'none'})")


def _jsonable(value):
    import json

    return json.loads(json.dumps(value, default=str))


@contextlib.contextmanager
def _quiet():
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
