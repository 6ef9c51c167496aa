"""The `kto` section: the objective a `training.type: kto` run minimises on completions labelled
desirable or not (TRL's KTOTrainer names: beta, desirable_weight, undesirable_weight).
engine/recipe/kto/ is its room: the loss, the run, the held-out metrics, which read `beta` for
the implicit reward they report.

Like the dpo section (finetune/config/preference.py), the section brings its own facts: each
key's fingerprint flag, its rows of the compatibility table (`ROWS`), and the method's facts
(the rows it trains on: finetune.config.methods).
"""

from __future__ import annotations

from finetune.config import compat
from finetune.config.methods import Method, register_method
from finetune.config.section import Field, Section

#: kto's facts for the config and the stages (its run class: engine.recipe.kto)
register_method(Method("kto", accepts=("unpaired",), data_hint=(
    "trains on completions labelled desirable or not; set data.dataset_type: "
    "unpaired_preference (prompt, completion, label: true/false)"),
    # reward_margin: a difference of the two labels' means, not a mean over rows
    stderr=lambda cfg, metric: False if metric == "reward_margin" else None,
    default_gate="eval.kto_accuracy"))


class KTOConfig(Section):
    """Kahneman-Tversky optimisation, on the rows of an `unpaired_preference` dataset."""

    beta: float = Field(
        0.1, fingerprint=True, gt=0,
        description="How far the policy may move from the reference: the implicit reward is "
        "beta x (log pi - log pi_ref), compared with the batch's KL estimate.")
    desirable_weight: float = Field(
        1.0, fingerprint=True, gt=0,
        description="The weight of a desirable completion's loss. With more desirable than "
        "undesirable rows, TRL advises desirable_weight x n_desirable / (undesirable_weight x "
        "n_undesirable) in [1, 4/3].")
    undesirable_weight: float = Field(
        1.0, fingerprint=True, gt=0,
        description="The weight of an undesirable completion's loss.")


KTO = compat.When("training.type kto", lambda c: c.training.type == "kto")
_EXAMPLE = {"training.type": "kto", "data.dataset_type": "unpaired_preference"}

#: kto's rows of the compatibility table (finetune/config/compat.py): what a kto run cannot be
#: combined with
ROWS: list[compat.Rule] = [
    compat.Refuse(
        "config", "training.per_device_train_batch_size", KTO,
        "the KL estimate pairs each prompt with another row's completion of the micro-batch: "
        "set 2 or more", used=lambda c: c.training.per_device_train_batch_size < 2,
        example={**_EXAMPLE, "training.per_device_train_batch_size": 1}),
    *compat.offline_method_refusals(
        KTO, _EXAMPLE, scored="each completion", rows="labelled rows",
        batches="each row with its mismatched KL row", loss="KTO's"),
]
compat.add_rows("kto", ROWS)
