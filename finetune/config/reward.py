"""The `reward` section: a reward model's objective for a `training.type: reward` run (TRL's
RewardTrainer: the Bradley-Terry loss on chosen/rejected pairs, with the pairs' optional
`margin` column and TRL's `center_rewards_coefficient`). engine/recipe/reward/ is its room.

As for dpo (finetune/config/preference.py), the section brings its own facts: the keys'
fingerprint flags, `ROWS` (what a reward run cannot be combined with) and the method's facts:
it trains on pairs, and the model it trains is a sequence classifier with one output (the
reward), whatever the dataset type's own model is.
"""

from __future__ import annotations

from finetune.config import compat
from finetune.config.methods import Method, register_method
from finetune.config.section import Field, Section
from finetune.datatypes.base import SEQUENCE_CLASSIFICATION

#: the head's one output, as a classifier's label map names it (labels.json, id2label)
REWARD_LABEL = "reward"

#: the evaluate stage's numbers for each model (engine.recipe.reward.heldout)
HELDOUT_METRICS = ("loss", "preference_accuracy", "reward_margin")

#: reward's facts for the config and the stages (its run class: engine.recipe.reward)
register_method(Method(
    "reward", accepts=("pairs",), task=SEQUENCE_CLASSIFICATION,
    data_hint=("trains on chosen/rejected pairs; set data.dataset_type: preference (every "
               "source, in a mixture)"),
    metrics=lambda cfg: HELDOUT_METRICS, metric_pattern=r"preference_accuracy|reward_margin",
    # the pair loss is a mean over pairs: its stderr holds whatever the dataset's rule says
    stderr=lambda cfg, metric: True if metric in ("loss", "perplexity") else None,
    default_gate="eval.preference_accuracy"))


class RewardConfig(Section):
    """A reward model on pairs of a `preference` dataset: a one-output sequence classification
    head trained so that the chosen side scores above the rejected one."""

    center_rewards_coefficient: float | None = Field(
        None, ge=0, fingerprint=True,
        description="Adds this times the mean of (r_chosen + r_rejected)^2 to the loss, so the "
        "rewards stay centred on 0 (TRL's name; null: off). A pair's `margin` column, when the "
        "rows have one, is subtracted from r_chosen - r_rejected inside the loss.")


REWARD = compat.When("training.type reward", lambda c: c.training.type == "reward")

#: what a reward run cannot be combined with (rows across sections, as dpo's)
ROWS: list[compat.Rule] = compat.offline_method_refusals(
    REWARD, {"training.type": "reward", "data.dataset_type": "preference"},
    scored="each side of a pair", rows="pairs", batches="each pair's two sides",
    loss="the Bradley-Terry loss")
compat.add_rows("reward", ROWS)
