"""lm-evaluation-harness tasks in the evaluate stage (`eval.harness`).

What resolves and runs a task on a loaded model is engine.evaluation.harness, through the
doors (engine.preflight resolves for validate, engine.evaluate runs for this stage): the one
implementation in-training evaluation runs too (`eval.during_training_metrics` naming
`harness.<task>.<metric>.<filter>`). The tasks run through lm-eval's own Python API
(`simple_evaluate`) on the models the stage has already loaded, wrapped in lm-eval's HF backend
(`HFLM`): the harness's prompts, few-shot sampling, generation settings, filters and metrics
are its own, and nothing is loaded or written twice. A task is a name lm-eval knows (its data
comes from the hub) or a task YAML in the project, or a folder of them
(`data/harness/gsm8k_local.yaml`: GSM8K's official task on the shipped rows, offline). Results
land in eval.json under each model as `harness.<task>.<metric>.<filter>` (and `..._stderr`),
which the registry gate can name.

lm-eval is an optional extra (`pip install 'finetune-pipeline[harness]'`): without it a params
file that names harness tasks is refused with one line.
"""

from __future__ import annotations

from pathlib import Path

from engine.preflight import INSTALL, require_lm_eval, resolve_tasks
from finetune.errors import PipelineError

__all__ = ["INSTALL", "chat_tokenizer", "check_gate", "require_lm_eval", "resolve_tasks",
           "run"]


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
    """The tasks on one loaded model with eval.harness's settings: (flat metrics
    `harness.<task>.<metric>.<filter>`, lm-eval's full results), by
    engine.evaluation.harness, which in-training evaluation runs too."""
    from engine.evaluate import flatten, run_tasks  # the evaluate stage's door (validate: not)

    results = run_tasks(model, tok, root, names, manager, batch_size=harness.batch_size,
                        num_fewshot=harness.num_fewshot, limit=harness.limit,
                        apply_chat_template=harness.apply_chat_template,
                        max_gen_toks=harness.max_gen_toks)
    return flatten(results["results"]), results


def check_gate(gate_metric: str, finetuned: dict) -> None:
    """A harness gate metric the tasks did not report is one line listing those they did."""
    key = gate_metric.removeprefix("eval.")
    if key.startswith("harness.") and key not in finetuned:
        reported = sorted("eval." + k for k in finetuned if k.startswith("harness."))
        raise PipelineError(f"registry.gate_metric {gate_metric} is not a metric the harness "
                            f"tasks reported (they reported {', '.join(reported) or 'none'})")
