"""The evaluate stage's one door into the engine: load the base and the fine-tuned model, and
ask the run's method for its held-out numbers.

tasks/evaluate.py imports this module and no other engine module (tests/test_layering.py), so
what a method measures lives in its room (`heldout_metrics` on its run class: SFT's loss,
perplexity and generations in engine.recipe.sft, a classifier's classes in
engine.recipe.classifier, DPO's pair ranking in engine.recipe.dpo) and a new method needs no
edit to the stage. The stage keeps what is the pipeline's: the generation prompts from the
formatted test rows, the dataset types' scoring, the metrics files and MLflow; lm-eval's tasks
run through engine.evaluation.harness, which in-training evaluation runs too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from engine.datapath.data import load_tokenized
from engine.evaluation.harness import flatten, run_tasks
from engine.evaluation.heldout import Evaluated, HeldOut
from engine.kinds import kind_of
from engine.modeling.labels import read_labels
from engine.modeling.model import base_model, load_base_model, load_tokenizer, load_trained
from engine.process.distributed import choose_device
from engine.recipe.run import run_class
from finetune.config import FinetuneConfig
from finetune.config.compat import check_machine

__all__ = ["Evaluated", "HeldOut", "check_evaluation_machine", "flatten", "heldout_metrics",
           "load_tokenizer", "run_tasks", "transformers_model"]


def check_evaluation_machine(cfg: FinetuneConfig) -> None:
    """What this machine cannot load the model with, as one line (the model section's rows
    of finetune/config/compat.py)."""
    check_machine(cfg, choose_device(cfg.training.resolved_device), sections=("model",))


def heldout_metrics(cfg: FinetuneConfig, root: Path, trained: Path, test_dir: Path,
                    rows: Callable[[], Any], make_scorer: Callable[[Any, list | None], Any]
                    ) -> tuple[Evaluated, HeldOut]:
    """The method's numbers for the base and the fine-tuned model on the tokenized test split
    at `test_dir`, and the models it measured (lm-eval runs on the same ones). `rows()`: the
    generation prompts and references, or None; `make_scorer(tokenizer, labels)`: the dataset
    types' scoring (`.generations(rows, texts)`: the scores and the per-row values of those
    that are means over rows; `.classes(predicted, true)`)."""
    method = run_class(cfg)
    tok = load_tokenizer(cfg.model, root)
    labels = read_labels(trained)  # a classifier's class names, saved with its weights
    held = HeldOut(
        cfg=cfg, root=root, trained=trained, test=load_tokenized(test_dir, (*method.columns, *kind_of(cfg).data_columns)),
        tokenizer=tok, labels=labels, base=load_base_model(cfg.model, root, labels=labels),
        load_tuned=lambda base: load_trained(cfg.model, cfg.peft, root, trained, base=base),
        rows=rows, scorer=make_scorer(tok, labels))
    return method.heldout_metrics(held), held


def transformers_model(model):
    """The transformers model inside a PEFT wrapper (what lm-eval's HF backend takes)."""
    return base_model(model)
