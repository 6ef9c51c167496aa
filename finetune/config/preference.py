"""The `dpo` section: the preference objective a `training.type: dpo` run minimises (TRL's
names: beta, loss_type, label_smoothing, precompute_ref_log_probs). engine/recipe/dpo/ is its
room: the loss, the run, the held-out ranking, which reads `beta` for the implicit reward it
reports.

The section brings its own facts: each key's field says whether it is in a checkpoint's
fingerprint, `ROWS` are its rows of the compatibility table (`compat.add_rows`), and the
method's facts (the rows it trains on: finetune.config.methods) are registered here, so this
module is the one a method's keys are declared in.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from finetune.config import compat
from finetune.config.methods import Method, register_method
from finetune.config.section import Field, Section

#: dpo's facts for the config and the stages (its run class: engine.recipe.dpo)
register_method(Method("dpo", accepts=("pairs",), data_hint=(
    "trains on chosen/rejected pairs; set data.dataset_type: preference (every source, in a "
    "mixture)"), default_gate="eval.preference_accuracy"))

#: the losses that compare the policy with a reference model (the others are reference-free)
REFERENCE_LOSSES = ("sigmoid", "ipo", "robust")


class DPOConfig(Section):
    """Direct preference optimisation and its relatives, on pairs of a `preference` dataset."""

    beta: float = Field(
        0.1, fingerprint=True, gt=0,
        description="How far the policy may move from the reference: the implicit reward is "
        "beta x (log pi - log pi_ref). For ipo the regularisation tau; for simpo the reward "
        "scale of the length-averaged log-probabilities; for orpo the weight of the "
        "odds-ratio term (TRL's lambda).")
    loss_type: Literal["sigmoid", "ipo", "robust", "simpo", "orpo"] = Field(
        "sigmoid", fingerprint=True,
        description="sigmoid (DPO), ipo (squared loss on the length-averaged log-ratio "
        "margin), robust (DPO robust to flipped labels, label_smoothing = the flip rate), "
        "simpo (reference-free: length-averaged log-probabilities with a target margin "
        "simpo_gamma; no reference forward at all), orpo (reference-free: the chosen side's "
        "NLL, prompt included as TRL's ORPO trains it, plus beta x the log odds ratio of the "
        "length-averaged log-probabilities).")
    label_smoothing: float = Field(
        0.0, fingerprint=True, ge=0, lt=0.5,
        description="sigmoid and simpo: conservative DPO, the probability a pair's label is "
        "wrong (the loss mixes in the flipped pair); robust: the flip rate its unbiased loss "
        "corrects for. Below 0.5.")
    simpo_gamma: float = Field(
        0.5, ge=0, fingerprint=True,
        description="simpo: the target reward margin between chosen and rejected.")
    precompute_ref_log_probs: bool = Field(
        False, fingerprint=True,
        description="Compute the reference log-probabilities of every training pair once, "
        "before the first step, instead of a reference forward per step (TRL's name): each "
        "step then costs one forward and backward of the policy.")

    @model_validator(mode="after")
    def _compat(self) -> "DPOConfig":
        compat.check(self, "dpo")  # the rules among dpo keys (ROWS, in compat's table)
        return self

    @property
    def uses_reference(self) -> bool:
        return self.loss_type in REFERENCE_LOSSES


DPO = compat.When("training.type dpo", lambda c: c.training.type == "dpo")

#: dpo's rows of the compatibility table (finetune/config/compat.py), joined once this module
#: is imported: the rules among the dpo keys, and what a dpo run cannot be combined with
ROWS: list[compat.Rule] = [
    *(compat.Refuse(
        "dpo", "precompute_ref_log_probs",
        compat.When(f"loss_type {loss}", lambda d, loss=loss: d.loss_type == loss),
        f"{loss} is reference-free: there are no reference log-probabilities to precompute",
        example={"dpo.loss_type": loss, "dpo.precompute_ref_log_probs": True})
      for loss in ("simpo", "orpo")),
    compat.Refuse(
        "dpo", "label_smoothing", compat.When("loss_type orpo", lambda d: d.loss_type == "orpo"),
        "orpo's odds-ratio term has no label smoothing",
        example={"dpo.loss_type": "orpo", "dpo.label_smoothing": 0.1}),
    *compat.offline_method_refusals(
        DPO, {"training.type": "dpo", "data.dataset_type": "preference"},
        scored="each side of a pair", rows="pairs", batches="each pair's two sides",
        loss="dpo.loss_type's"),
]
compat.add_rows("dpo", ROWS)
