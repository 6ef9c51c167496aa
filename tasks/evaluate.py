"""Stage 5, evaluate: test-split loss and perplexity of the base and the fine-tuned model.

Both numbers come from the same tokenized test split with the same token-weighted loss the
trainer uses, so "fine-tuned below base" is an apples-to-apples claim. Results go to a DVC
metrics file (`dvc metrics diff`, `dvc exp show`) and into the training's MLflow run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.data import load_tokenized
from engine.evaluation import evaluate_loss
from engine.model import load_base_model, load_tokenizer, load_trained
from finetune.errors import PipelineError
from finetune.workspace import Workspace, write_json_atomic
from tasks import tracking


def evaluate(ws: Workspace) -> dict[str, Path]:
    cfg = ws.config
    test_dir = ws.layout.tokenized / "test"
    if not test_dir.exists():
        raise PipelineError(f"{test_dir} missing: set data.test_split (or split_ratio) and rerun")
    if not ws.layout.trained.exists():
        raise PipelineError(f"{ws.layout.trained} missing; run the train stage first")
    torch.manual_seed(cfg.training.seed)
    test = load_tokenized(test_dir)
    tok = load_tokenizer(cfg.model, ws.root)
    # The whole split: eval.eval_batches caps only the quick in-training evals.
    args = (test, cfg.training.per_device_eval_batch_size, tok.pad_token_id)
    base_model = load_base_model(cfg.model, ws.root)
    base = evaluate_loss(base_model, *args)
    tuned = evaluate_loss(load_trained(cfg.model, cfg.peft, ws.root, ws.layout.trained,
                                       base=base_model), *args)
    metrics = {
        "base": {"loss": round(base["loss"], 6), "perplexity": round(base["perplexity"], 4)},
        "finetuned": {"loss": round(tuned["loss"], 6), "perplexity": round(tuned["perplexity"], 4)},
        "eval_tokens": tuned["tokens"],
    }
    path = write_json_atomic(ws.layout.metrics / "eval.json", metrics)
    run_id = tracking.run_id_of(ws)
    if run_id:
        tracking.log_metrics(ws, run_id, {
            "eval.base_loss": base["loss"], "eval.base_perplexity": base["perplexity"],
            "eval.loss": tuned["loss"], "eval.perplexity": tuned["perplexity"],
        })
    return {"metrics": path}
