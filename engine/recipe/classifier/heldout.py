"""A sequence classifier's held-out numbers: loss and the dataset type's scores (accuracy,
macro-F1) of the base model (its head untrained: chance) and the fine-tuned classifier, with
accuracy's bootstrap stderr over the rows (the loss and macro-F1 get none); the samples table
shows text, label and both predictions."""

from __future__ import annotations

from engine.evaluation.bootstrap import bootstrap_seed, stderrs
from engine.evaluation.heldout import Evaluated, HeldOut, evaluate_loss, predict_classes
from engine.kinds.classifier import class_loss_sum
from finetune.errors import PipelineError


def classifier_metrics(held: HeldOut) -> Evaluated:
    cfg, tok, labels = held.cfg, held.tokenizer, held.labels
    if not labels:
        raise PipelineError(f"{held.trained}/labels.json missing: the trained classifier "
                            "has no label map; run the train stage again")
    args = (held.test, cfg.training.per_device_eval_batch_size, tok.pad_token_id)
    results, predictions = {}, {}
    for name in ("base", "finetuned"):
        model = held.base if name == "base" else held.tuned()
        loss = evaluate_loss(model, *args, loss_sum_fn=class_loss_sum)
        predicted, true = predict_classes(model, *args)
        scores = held.scorer.classes(predicted, true)
        correct = [float(p == t) for p, t in zip(predicted, true)]
        results[name] = {"loss": round(loss["loss"], 6),
                         **{k: round(v, 6) for k, v in scores.items()},
                         **stderrs({"accuracy": correct}, cfg.eval.bootstrap_samples,
                                   bootstrap_seed(cfg))}
        predictions[name] = predicted
    samples = [{"text": tok.decode(held.test[i]["input_ids"], skip_special_tokens=True),
                "reference": labels[t],
                "prediction": labels[predictions["finetuned"][i]],
                "base_prediction": labels[predictions["base"][i]]}
               for i, t in enumerate(true[: cfg.eval.num_logged_samples])]
    return Evaluated(results, {"eval_rows": len(true), "num_labels": len(labels)}, samples)
