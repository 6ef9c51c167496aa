"""Stage 5, evaluate: loss, perplexity and the dataset type's metrics of the base and
fine-tuned model.

Loss numbers come from the same tokenized test split with the same token-weighted loss the
trainer uses, so "fine-tuned below base" is an apples-to-apples claim. A language model's
predictions are greedy generations on the first `eval.max_generation_samples` prompts of the
formatted test rows (the prompt encoded exactly as in training); a classifier's are its
head's classes on the tokenized test split. The dataset type says what the prompts and
references are and scores the predictions (exact match and ROUGE for generations, accuracy and
macro-F1 for a classifier). Results go to a DVC metrics file (`dvc metrics diff`, `dvc exp
show`), a samples table, and the training's MLflow run.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pandas as pd
import torch

from engine.datapath.data import load_tokenized
from engine.evaluation.generation import encode_prompts, greedy_generate
from engine.evaluation.heldout import evaluate_loss, pair_log_probs, predict_classes
from engine.modeling.adapter import adapter_disabled, has_adapter
from engine.modeling.labels import read_labels
from engine.modeling.model import base_model as unwrapped
from engine.modeling.model import load_base_model, load_tokenizer, load_trained, max_positions
from engine.modeling.quantization import quantized_copy
from engine.objective.loss import class_loss_sum
from engine.objective.preference import ranking_scores
from engine.process.distributed import choose_device
from finetune.config.compat import check_machine
from finetune.datatypes import DataContext
from finetune.errors import PipelineError
from finetune.files import write_json_atomic
from finetune.workspace import Workspace
from tasks import tracking
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
    cfg = ws.config
    check_machine(cfg, choose_device(cfg.training.resolved_device), sections=("model",))
    test_dir = ws.layout.tokenized / "test"
    if not test_dir.exists():
        raise PipelineError(f"{test_dir} missing: set data.test_split (or split_ratio) and rerun")
    if not ws.layout.trained.exists():
        raise PipelineError(f"{ws.layout.trained} missing; run the train stage first")
    torch.manual_seed(_training_seed(ws))
    test = load_tokenized(test_dir)
    tok = load_tokenizer(cfg.model, ws.root)
    if cfg.data.task.classifier:
        return _evaluate_classifier(ws, test, tok)
    rows = _generation_rows(ws) if cfg.eval.wants_generation else None
    # The whole split: eval.eval_batches caps only the quick in-training evals.
    args = (test, cfg.training.per_device_eval_batch_size, tok.pad_token_id)
    base_model = load_base_model(cfg.model, ws.root)
    results, generations = {}, {}
    base_loss = evaluate_loss(base_model, *args)
    results["base"] = _loss_entry(base_loss)
    if rows is not None:
        generations["base"] = _generate(ws, base_model, tok, rows)
    tuned_model = load_trained(cfg.model, cfg.peft, ws.root, ws.layout.trained, base=base_model)
    tuned_loss = evaluate_loss(tuned_model, *args)
    results["finetuned"] = _loss_entry(tuned_loss)
    t = cfg.training
    if t.qat_recipe:  # the quantised model the export ships (engine.modeling.quantization)
        quantized, _ = quantized_copy(tuned_model, t.qat_recipe, t.qat_group_size)
        results["quantized"] = _loss_entry(evaluate_loss(quantized, *args))
        del quantized
    if cfg.data.parts()[0][1].datatype.paired:
        _rank_pairs(ws, results, test, tok, base_model, tuned_model)
    if rows is not None:
        generations["finetuned"] = _generate(ws, tuned_model, tok, rows)
        for name, texts in generations.items():
            scores = _score(ws, rows, texts, DataContext(ws.root, lambda: tok))
            results[name].update({k: round(v, 6) for k, v in scores.items()})
    harness_results = _harness(ws, results, tok, base_model, tuned_model)
    metrics = {**results, "eval_tokens": tuned_loss["tokens"],
               "generation_rows": 0 if rows is None else len(rows)}
    samples = _samples(rows, generations, cfg.eval.num_logged_samples)
    return _write(ws, metrics, samples, harness_results)


def _harness(ws: Workspace, results: dict, tok, base_model, tuned_model) -> dict | None:
    """eval.harness's lm-eval tasks on the base and the fine-tuned model (tasks.harness):
    their metrics into each model's results; lm-eval's full results, by model, returned."""
    harness = ws.config.eval.harness
    if not harness.tasks:
        return None
    names, manager = resolve_tasks(harness.tasks, ws.root)
    if harness.apply_chat_template:
        tok = chat_tokenizer(ws.layout.trained)
    full = {}
    for name in harness.models:
        with (_as_base(tuned_model, base_model) if name == "base"
              else contextlib.nullcontext(tuned_model)) as model:
            # lm-eval's HF backend takes the transformers model (the adapter's layers inside)
            flat, full[name] = run_harness(harness, unwrapped(model), tok, ws.root, names,
                                           manager)
        results[name].update({k: round(v, 6) for k, v in flat.items()})
    if "finetuned" in harness.models:
        check_gate(ws.config.registry.gate_metric, results["finetuned"])
    return full


@contextlib.contextmanager
def _as_base(tuned_model, base_model):
    """The base model, once the fine-tuned one is loaded: load_trained injects an adapter into
    base_model in place, so the base is then the fine-tuned model with its adapter disabled."""
    if not has_adapter(tuned_model):
        yield base_model
        return
    with adapter_disabled(tuned_model):
        yield tuned_model


def _rank_pairs(ws: Workspace, results: dict, test, tok, base_model, tuned_model) -> None:
    """Preference pairs: how the base and the fine-tuned model rank each held-out pair's
    chosen side over its rejected one, by the implicit reward against the base and by their
    own likelihood (engine.objective.preference.ranking_scores)."""
    args = (test, ws.config.training.per_device_eval_batch_size, tok.pad_token_id)
    dpo = ws.config.dpo
    with _as_base(tuned_model, base_model) as model:
        base = pair_log_probs(model, *args)
    tuned = pair_log_probs(tuned_model, *args)
    for name, scored in (("base", base), ("finetuned", tuned)):
        results[name].update(
            {k: round(v, 6) for k, v in ranking_scores(scored, base, dpo).items()})


def _evaluate_classifier(ws: Workspace, test, tok) -> dict[str, Path]:
    """Loss and the type's scores (accuracy, macro-F1) of the base model (its head untrained:
    chance) and the fine-tuned classifier; the samples table shows text, label and both
    predictions."""
    cfg = ws.config
    labels = read_labels(ws.layout.trained)
    if not labels:
        raise PipelineError(f"{ws.layout.trained}/labels.json missing: the trained classifier "
                            "has no label map; run the train stage again")
    ctx = DataContext(ws.root, lambda: tok, labels=labels)
    datatype = cfg.data.parts()[0][1].datatype
    args = (test, cfg.training.per_device_eval_batch_size, tok.pad_token_id)
    base_model = load_base_model(cfg.model, ws.root, labels=labels)
    results, predictions = {}, {}
    for name in ("base", "finetuned"):
        model = base_model if name == "base" else load_trained(
            cfg.model, cfg.peft, ws.root, ws.layout.trained, base=base_model)
        loss = evaluate_loss(model, *args, loss_sum_fn=class_loss_sum)
        predicted, true = predict_classes(model, *args)
        scores = datatype.score(predicted, true, cfg.eval, ctx)
        results[name] = {"loss": round(loss["loss"], 6),
                         **{k: round(v, 6) for k, v in scores.items()}}
        predictions[name] = predicted
    samples = [{"text": tok.decode(test[i]["input_ids"], skip_special_tokens=True),
                "reference": labels[t],
                "prediction": labels[predictions["finetuned"][i]],
                "base_prediction": labels[predictions["base"][i]]}
               for i, t in enumerate(true[: cfg.eval.num_logged_samples])]
    return _write(ws, {**results, "eval_rows": len(true), "num_labels": len(labels)}, samples)


def _write(ws: Workspace, metrics: dict, samples: list[dict],
           harness: dict | None = None) -> dict[str, Path]:
    """The metrics file, the samples table, and both into the training's MLflow run (with
    lm-eval's full results of `harness`, by model)."""
    results = {k: v for k, v in metrics.items() if k in ("base", "finetuned", "quantized")}
    samples_path = write_json_atomic(ws.layout.eval_samples, samples)
    path = write_json_atomic(ws.layout.metrics / "eval.json", metrics)
    run_id = tracking.run_id_of(ws)
    if run_id:
        flat = {f"eval.{k}": v for k, v in results["finetuned"].items()}
        flat.update({f"eval.base_{k}": v for k, v in results["base"].items()})
        flat.update({f"eval.quantized_{k}": v for k, v in results.get("quantized", {}).items()})
        tracking.log_metrics(ws, run_id, flat)
        if samples:
            tracking.client(ws).log_table(run_id, pd.DataFrame(samples), "eval/samples.json")
        if harness:
            tracking.client(ws).log_dict(run_id, harness, "eval/harness.json")
    return {"metrics": path, "samples": samples_path}


def _loss_entry(result: dict) -> dict:
    return {"loss": round(result["loss"], 6), "perplexity": round(result["perplexity"], 4)}


def _generation_rows(ws: Workspace) -> pd.DataFrame:
    """The prompts and references each source's type makes of its formatted test rows (the
    sources in order, column `part` numbering them), the first `eval.max_generation_samples`
    of them."""
    frames = []
    for i, (name, data) in enumerate(ws.config.data.parts()):
        test = (ws.layout.formatted / name if name else ws.layout.formatted) / "test.parquet"
        if not test.exists():
            raise PipelineError(f"{test} missing; run the format stage first")
        frames.append(data.datatype.eval_rows(pd.read_parquet(test)).assign(part=i))
    rows = pd.concat(frames, ignore_index=True)
    limit = ws.config.eval.max_generation_samples
    return rows.head(limit) if limit else rows


def _score(ws: Workspace, rows: pd.DataFrame, predictions: list[str],
           ctx: DataContext) -> dict[str, float]:
    """Each source's type scores its own rows; sources of one type are scored together, and
    several types' scores (means over rows) are combined weighted by their rows."""
    parts = ws.config.data.parts()
    groups: dict[type, list[int]] = {}
    for i, part in enumerate(rows["part"]):
        groups.setdefault(type(parts[part][1].datatype), []).append(i)
    scored = []
    for positions in groups.values():
        datatype = parts[int(rows["part"].iloc[positions[0]])][1].datatype
        scored.append((len(positions), datatype.score(
            [predictions[i] for i in positions], rows["reference"].iloc[positions].tolist(),
            ws.config.eval, ctx)))
    if len(scored) == 1:
        return scored[0][1]
    return {key: sum(n * scores.get(key, 0.0) for n, scores in scored) / len(rows)
            for key in {k for _, scores in scored for k in scores}}


def _generate(ws: Workspace, model, tok, rows: pd.DataFrame) -> list[str]:
    ev = ws.config.eval
    limit = max_positions(ws.config.model, ws.root)
    room = limit - ev.generation_max_new_tokens if limit else None
    if room is not None and room < 1:
        raise PipelineError(
            f"eval.generation_max_new_tokens {ev.generation_max_new_tokens} leaves no room for "
            f"a prompt in the model's {limit} positions; lower it"
        )
    prompts = encode_prompts(tok, rows["prompt"].tolist(), room)
    return greedy_generate(model, tok, prompts, ws.config.training.per_device_eval_batch_size,
                           ev.generation_max_new_tokens)


def _samples(rows: pd.DataFrame | None, generations: dict[str, list[str]], n: int) -> list[dict]:
    """The first n rows side by side: what a reviewer reads before trusting a number."""
    if rows is None or n == 0:
        return []
    head = rows.head(n)
    return [
        {"prompt": prompt, "reference": reference,
         "generation": generations["finetuned"][i], "base_generation": generations["base"][i]}
        for i, (prompt, reference) in enumerate(zip(head["prompt"], head["reference"]))
    ]
