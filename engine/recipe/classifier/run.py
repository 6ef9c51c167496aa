"""A sequence classifier's run: the SFT loop unchanged (model setup gives the head its classes
and the loss its per-row form from the label map); what differs is what the evaluate stage
measures (engine.recipe.classifier.heldout)."""

from __future__ import annotations

from engine.recipe.classifier.heldout import classifier_metrics
from engine.recipe.run import TrainingRun


class ClassifierRun(TrainingRun):
    """`training.type: sft` on a classification task."""

    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        return classifier_metrics(held)
