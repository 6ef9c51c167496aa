"""A sequence classifier's room: the SFT loop with a classification head (the dataset type's
model task decides the head, engine.objective.loss its loss), and `heldout` its
evaluate-stage numbers (loss, accuracy, macro-F1 of the head's classes). The trainer registry
runs `run:ClassifierRun` for `training.type: sft` on a classification task."""
