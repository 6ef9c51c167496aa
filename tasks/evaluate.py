"""Stage 5, evaluate: the base and the fine-tuned model measured on held-out data, as the
run's method measures them.

The engine loads both models and asks the method (engine.evaluate, the stage's one door):
a language model reports loss and perplexity from the same tokenized test split and the same
token-weighted loss the trainer uses (so "fine-tuned below base" is an apples-to-apples claim)
and greedy generations on the first `eval.max_generation_samples` prompts of the formatted test
rows; a classifier its head's classes; DPO adds how each model ranks the held-out pairs. The
stage supplies what is the pipeline's: the prompts and references each dataset type makes of
its formatted rows and the type's scoring (exact match and ROUGE for generations, accuracy and
macro-F1 for a classifier), lm-eval tasks, and the outputs: a DVC metrics file (`dvc metrics
diff`, `dvc exp show`), a samples table, and the training's MLflow run.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pandas as pd
import torch

from engine.evaluate import (
    check_evaluation_machine,
    heldout_metrics,
    transformers_model,
)
from finetune.datatypes import DataContext
from finetune.datatypes.generations import generation_rows, score_generations
from finetune.errors import PipelineError
from finetune.files import write_json_atomic
from finetune.workspace import Workspace
from tasks import contamination, model_refs, tracking
from tasks.gate import contamination_metrics
from tasks.harness import chat_tokenizer, check_gate, resolve_tasks
from tasks.harness import run as run_harness


def _training_seed(ws: Workspace) -> int:
    """training.seed, or for an unseeded run (null) the seed its training drew."""
    if ws.config.training.seed is not None:
        return ws.config.training.seed
    metrics = ws.layout.metrics / "train.json"
    recorded = json.loads(metrics.read_text()).get("seed") if metrics.exists() else None
    if recorded is None:
        raise PipelineError(f"training.seed is null and {metrics} records no drawn seed; "
                            "run the train stage first")
    return recorded


def evaluate(ws: Workspace) -> dict[str, Path]:
    ws = model_refs.resolved(ws)  # models:/ references -> their downloaded files
    cfg = ws.config
    check_evaluation_machine(cfg)
    test_dir = ws.layout.tokenized / "test"
    if not test_dir.exists():
        raise PipelineError(f"{test_dir} missing: set data.test_split (or split_ratio) and rerun")
    if not ws.layout.trained.exists():
        raise PipelineError(f"{ws.layout.trained} missing; run the train stage first")
    torch.manual_seed(_training_seed(ws))
    evaluated, held = heldout_metrics(
        cfg, ws.root, ws.layout.trained, test_dir,
        rows=lambda: (generation_rows(cfg, ws.layout.formatted) if cfg.eval.wants_generation
                      else None),
        make_scorer=lambda tok, labels: _Scorer(ws, tok, labels))
    tasks = (resolve_tasks(cfg.eval.harness.tasks, ws.root) if cfg.eval.harness.tasks
             else None)
    harness_results = _harness(ws, evaluated.results, held, tasks)
    metrics = {**evaluated.results, **evaluated.counts}
    report = None
    if cfg.eval.contamination_ngram:
        report = contamination.measure(ws, tasks)
        metrics["contamination"] = contamination.metrics(report)
    return _write(ws, metrics, evaluated.samples, harness_results, report)


class _Scorer:
    """The dataset types' scoring, for the method's held-out numbers: generated texts against
    each source's references, a classifier's predicted classes against the true ones."""

    def __init__(self, ws: Workspace, tok, labels: list[str] | None):
        self.ws = ws
        self.ctx = DataContext(ws.root, lambda: tok, labels=labels)

    def generations(self, rows: pd.DataFrame, texts: list[str]
                    ) -> tuple[dict[str, float], dict[str, list[float]]]:
        """The metrics, and the per-row values of those that are means over all the rows
        (for their bootstrap stderr)."""
        return score_generations(self.ws.config, rows, texts, self.ctx)

    def classes(self, predicted: list[int], true: list[int]) -> dict[str, float]:
        datatype = self.ws.config.data.parts()[0][1].datatype
        return datatype.score(predicted, true, self.ws.config.eval, self.ctx)


def _harness(ws: Workspace, results: dict, held, tasks) -> dict | None:
    """eval.harness's lm-eval tasks (`tasks`: their names and lm-eval's TaskManager, as
    tasks.harness resolves them) on the base and the fine-tuned model: their metrics into
    each model's results; lm-eval's full results, by model, returned."""
    harness = ws.config.eval.harness
    if not tasks:
        return None
    names, manager = tasks
    tok = chat_tokenizer(ws.layout.trained) if harness.apply_chat_template else held.tokenizer
    full = {}
    for name in harness.models:
        with (held.as_base() if name == "base"
              else contextlib.nullcontext(held.tuned())) as model:
            # lm-eval's HF backend takes the transformers model (the adapter's layers inside)
            flat, full[name] = run_harness(harness, transformers_model(model), tok, ws.root,
                                           names, manager)
        results[name].update({k: round(v, 6) for k, v in flat.items()})
    if "finetuned" in harness.models:
        check_gate(ws.config.registry.gate_metric, results["finetuned"])
    return full


def _write(ws: Workspace, metrics: dict, samples: list[dict], harness: dict | None = None,
           contaminated: dict | None = None) -> dict[str, Path]:
    """The metrics file, the samples table, the contamination check's rows, and all of them
    into the training's MLflow run (with lm-eval's full results of `harness`, by model)."""
    samples_path = write_json_atomic(ws.layout.eval_samples, samples)
    # a DVC output either way: with the check off, an empty report (no old rows left behind)
    write_json_atomic(ws.layout.eval_samples.parent / "contamination.json",
                      contaminated or {"ngram": None, "sets": {}})
    path = write_json_atomic(ws.layout.metrics / "eval.json", metrics)
    run_id = tracking.run_id_of(ws)
    if run_id:
        # one value each, at step 0: MLflow draws such a metric as a bar labelled with it
        tracking.log_metrics(ws, run_id, mlflow_metrics(metrics), step=0)
        if samples:
            tracking.client(ws).log_table(run_id, pd.DataFrame(samples), "eval/samples.json")
        if harness:
            tracking.client(ws).log_dict(run_id, harness, "eval/harness.json")
        if contaminated is not None:
            tracking.client(ws).log_dict(run_id, contaminated, "eval/contamination.json")
    return {"metrics": path, "samples": samples_path}


def mlflow_metrics(metrics: dict) -> dict[str, float]:
    """The metrics file's numbers as the training's MLflow run (and so the promotion gate)
    names them: the fine-tuned model's `eval.<metric>` (its stderr `eval.<metric>_stderr`,
    which is where finetune.config.registry.stderr_key looks), the base's `eval.base_<metric>`,
    the quantized model's `eval.quantized_<metric>`, the contamination check's fractions."""
    flat = {f"eval.{k}": v for k, v in metrics["finetuned"].items()}
    flat.update({f"eval.base_{k}": v for k, v in metrics["base"].items()})
    flat.update({f"eval.quantized_{k}": v for k, v in metrics.get("quantized", {}).items()})
    flat.update(contamination_metrics(metrics.get("contamination", {})))
    return flat

