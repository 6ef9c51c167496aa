"""A sequence classifier (transformers' AutoModelForSequenceClassification): one label per row,
its class id on the last token, read from the head's (rows, classes) logits. The head gets one
output per class from the label map (labels.json, next to the data and the weights; a reward
model's one output: engine.recipe.reward), and SFT of a classifier is measured on classes, not
generations (engine.recipe.classifier)."""

from __future__ import annotations

import torch

from engine.kinds.base import ModelKind
from engine.objective.loss import FullLoss, UserLoss


def class_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of a sequence classifier: each row's one label (its class id, on
    the last token; every other position is IGNORE_INDEX, so the row maximum is the id)."""
    return torch.nn.functional.cross_entropy(logits.float(), labels.max(dim=1).values,
                                             reduction="sum")


class ClassificationLoss(FullLoss):
    """A sequence classifier's logits are (rows, classes): one target per row."""

    name = "classification"
    eval_loss_sum = staticmethod(class_loss_sum)

    def loss_sum(self, output, labels: torch.Tensor) -> torch.Tensor:
        return class_loss_sum(output.logits, labels)


class SequenceClassifier(ModelKind):
    name = "sequence_classifier"
    run_classes = {"sft": "engine.recipe.classifier.run:ClassifierRun"}

    def loss(self, model, cfg, device, amp, user_fn=None):
        """No vocabulary head to chunk: the per-row cross entropy (or the user's)."""
        return UserLoss(user_fn) if user_fn is not None else ClassificationLoss()
