"""The `distill` section: knowledge distillation (`training.type: distill`), a student trained
towards a teacher's next-token distributions with TRL's GKD names and meanings (GKDConfig:
`beta`, `lmbda`, `temperature`, `max_new_tokens`) plus two of ours: `mode` and `top_k` (the
offline teacher stage) and `alpha` (a share of the data's cross-entropy).

The loss is TRL's generalised Jensen-Shannon divergence per trained token (Agarwal et al.
2024, eq. 1): `beta` 0 is the forward KL(teacher || student), 1 the reverse KL(student ||
teacher), between them the JSD against the mixture beta x teacher + (1 - beta) x student.

- `mode: offline`: the `teacher` stage (tasks/teacher.py) runs the teacher once over the
  tokenized training rows and keeps, for each trained token, its `top_k` token ids and
  log-probabilities (a DVC output: every later student run reuses them); the loss is the
  divergence over those ids.
- `mode: on_policy`: with probability `lmbda` a step's completions are the student's own
  samples (the rollout room's generator), otherwise the data's; the teacher scores them in the
  training process and the loss is over the full vocabulary.

engine/recipe/distill/ is its room (the loss, the run, the held-out numbers).
"""

from __future__ import annotations

from typing import Literal

from finetune.config import compat
from finetune.config.methods import Method, register_method
from finetune.config.section import Field, Section

#: distill's facts for the config and the stages (its run class: engine.recipe.distill)
register_method(Method("distill", accepts=("tokens",), data_hint=(
    "trains on token rows (text, or prompt and completion): set a data.dataset_type whose "
    "rows are trained tokens"), sft_evaluation=True))


class DistillConfig(Section):
    """Knowledge distillation from a teacher with the student's tokenizer."""

    teacher: str | None = Field(
        None, fingerprint=True, model_ref="teacher",
        description="The teacher: a model folder (a path with a '/', a causal LM with its "
        "tokenizer) or a registered model, models:/NAME@alias or models:/NAME/VERSION. Its "
        "tokenizer must be the student's (the same vocabulary and ids): the teacher stage "
        "refuses another in one line naming both.")
    mode: Literal["offline", "on_policy"] = Field(
        "offline", fingerprint=True,
        description="offline: the teacher stage scores the training rows once (top_k ids "
        "and log-probs per trained token, a DVC output every student run reuses); "
        "on_policy: the teacher is loaded in training and scores the student's own samples "
        "(with probability lmbda) or the data's completions.")
    top_k: int = Field(
        32, ge=1, fingerprint=True,
        description="offline: the teacher's most likely tokens kept per trained token; the "
        "divergence is over them (the vocabulary size gives the full-vocabulary loss).")
    temperature: float = Field(
        1.0, gt=0, fingerprint=True,
        description="Both distributions are of logits / temperature (TRL's "
        "generalized_jsd_loss); on-policy sampling uses it too (TRL's GKD samples at "
        "GKDConfig.temperature).")
    beta: float = Field(
        0.5, ge=0, le=1, fingerprint=True,
        description="The generalised JSD's interpolation (TRL's GKD): 0 forward KL "
        "(teacher || student), 1 reverse KL (student || teacher), between: JSD to the mixture "
        "beta x teacher + (1 - beta) x student.")
    lmbda: float = Field(
        0.5, ge=0, le=1, fingerprint=True,
        description="on_policy: the share of steps trained on the student's own samples "
        "(TRL's name and default); the rest train on the data's completions.")
    alpha: float = Field(
        0.0, ge=0, le=1, fingerprint=True,
        description="The share of the data's cross-entropy in the loss: (1 - alpha) x "
        "divergence + alpha x cross-entropy, per trained token (0: distillation only).")
    max_new_tokens: int = Field(
        128, ge=1, fingerprint=True,
        description="on_policy: most tokens the student samples per completion (TRL's "
        "GKDConfig name and default).")


DISTILL = compat.When("training.type distill", lambda c: c.training.type == "distill")
_EXAMPLE = {"training.type": "distill", "distill.teacher": "data/models/stories260K"}

#: distill's rows of the compatibility table (finetune/config/compat.py)
ROWS: list[compat.Rule] = [
    compat.Agree(
        "config", ("distill.teacher", "training.type"),
        lambda c: ("distill.teacher: null, and training.type distill needs a teacher (a "
                   "model folder or models:/NAME@alias)")
        if c.training.type == "distill" and c.distill.teacher is None else None,
        example={"training.type": "distill"}),
    *compat.offline_method_refusals(
        DISTILL, _EXAMPLE, scored="each row", rows="the teacher's columns",
        batches="each row with the teacher's columns", loss="the distillation divergence"),
]
compat.add_rows("distill", ROWS)
