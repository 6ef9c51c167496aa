"""The `grpo` section: online RL with reward functions (`training.type: grpo`), with TRL's
GRPOConfig names and meanings. The rollout's settings (sampling, rewards, tools, environments,
the clip bounds, beta) are every rollout method's (finetune/config/rollout.py); this section
adds GRPO's own: how advantages are scaled and aggregated, and the loss family (loss types,
the sequence-level ratio, two-sided clipping, the entropy and off-policy masks).
engine/recipe/grpo/ is its room: the group advantages, the clipped loss, the run and its
held-out metrics; the generator and the reward functions it uses are the rollout's
(engine/rollout/), which any method that generates can use.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from finetune.config import compat
from finetune.config.rollout import RolloutConfig, rollout_method
from finetune.config.section import Field


class GRPOConfig(RolloutConfig):
    """Group relative policy optimisation: sample a group of completions per prompt, score
    them with reward functions, and push up the ones above their group's mean."""

    SCOPE: ClassVar[str] = "grpo"

    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", fingerprint=True,
        description="Divide advantages by the reward std of the group, of the whole batch, "
        "or not at all (Dr. GRPO's advice).")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", fingerprint=True,
        description="How several reward functions become one advantage (TRL's name): "
        "sum_then_normalize (the weighted sum, normalised as scale_rewards says), or "
        "normalize_then_sum (GDPO: each function normalised within its group, the weighted "
        "sum then over the batch; a function with a wide range does not drown the others).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo",
                       "vespo"] = Field(
        "dapo", fingerprint=True,
        description="The surrogate and how token losses are averaged (TRL's names): grpo "
        "(per completion, then over completions), bnpo (over the micro-batch's tokens), "
        "dr_grpo (sum over a fixed num completions x max_completion_length), dapo (over the "
        "step's tokens, all ranks; TRL's default); cispo (the ratio, capped at epsilon_high, "
        "weights log pi, as dapo averages; ScaleRL recommends epsilon_high 5.0), sapo (a "
        "sigmoid soft clip instead of the hard one, sapo_temperature_pos/_neg, averaged as "
        "grpo), luspo (grpo's surrogate summed over each completion's tokens, averaged over "
        "completions; with importance_sampling_level sequence, as its paper), vespo (a gamma "
        "weight of the completion's ratio, vespo_k_*/vespo_lambda_*, times log pi, as dapo "
        "averages).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", fingerprint=True,
        description="The probability ratio per token, or per completion (GSPO: the exp of "
        "the mean token log-ratio; with loss_type grpo, sapo or luspo, whose averages keep "
        "it a per-completion objective).")
    delta: float | None = Field(
        None, gt=1, fingerprint=True,
        description="Two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta "
        "too, so a negative advantage cannot push a large ratio further (null: off; must be "
        "above 1 + epsilon_high).")
    sapo_temperature_pos: float = Field(
        1.0, gt=0, fingerprint=True,
        description="loss_type sapo: the soft clip's temperature for positive advantages.")
    sapo_temperature_neg: float = Field(
        1.05, gt=0, fingerprint=True,
        description="loss_type sapo: the soft clip's temperature for the others.")
    vespo_k_pos: float = Field(2.0, fingerprint=True,
                               description="loss_type vespo: k for non-negative advantages.")
    vespo_lambda_pos: float = Field(
        3.0, fingerprint=True, description="loss_type vespo: lambda for non-negative advantages.")
    vespo_k_neg: float = Field(3.0, fingerprint=True,
                               description="loss_type vespo: k for negative advantages.")
    vespo_lambda_neg: float = Field(
        2.0, fingerprint=True, description="loss_type vespo: lambda for negative advantages.")
    top_entropy_quantile: float = Field(
        1.0, gt=0, le=1, fingerprint=True,
        description="Beyond the 80/20 rule: only the completion tokens in this top share by "
        "entropy (over the micro-batch's tokens on all ranks, TRL's quantile) train the "
        "policy term (1: all; the paper's 0.2). The quantile is per micro-batch, as TRL's: "
        "accumulation is not one batch with it.")
    off_policy_mask_threshold: float | None = Field(
        None, ge=0, fingerprint=True,
        description="DeepSeek-V3.2's off-policy sequence mask: a completion with a negative "
        "advantage whose mean log(pi_old / pi) over its tokens exceeds this leaves the loss "
        "(null: off; e.g. 0.5). Needs num_iterations > 1 (with 1 the policy is the sampler "
        "and nothing would be masked) or use_vllm, whose server's log-probabilities it then "
        "compares with (TRL's).")
    use_bias_correction_kl: bool = Field(
        True, fingerprint=True,
        description="Weight the KL term by the probability ratio, so its gradient is the "
        "unbiased reverse-KL gradient (TRL's default; DeepSeek-V3.2).")


def _delta_above_the_clip(g: GRPOConfig) -> str | None:
    if g.delta is None or g.delta > 1 + g.clip_high:
        return None
    return (f"delta {g.delta} is not above 1 + epsilon_high ({1 + g.clip_high:g}): the cap "
            "would cut positive advantages below the clipped ratio; set it above, or null")


#: grpo's rows of the compatibility table (finetune/config/compat.py)
ROWS: list[compat.Rule] = [
    compat.Refuse("grpo", "importance_sampling_level", compat.When(
        "loss_type bnpo, dr_grpo, dapo or cispo",
        lambda g: g.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo")),
        "these sum token losses, which weights each completion's one ratio by its length "
        "instead of optimizing the per-completion objective (GSPO); use loss_type grpo, "
        "sapo or luspo", used=lambda g: g.importance_sampling_level == "sequence",
        example={"grpo.importance_sampling_level": "sequence", "grpo.loss_type": "dapo"}),
    compat.Refuse("grpo", "importance_sampling_level", compat.When(
        "loss_type vespo", lambda g: g.loss_type == "vespo"),
        "vespo weighs each completion by its own sequence-level ratio, from the token ratios",
        used=lambda g: g.importance_sampling_level == "sequence",
        example={"grpo.importance_sampling_level": "sequence", "grpo.loss_type": "vespo"}),
    compat.Refuse("grpo", "loss_type", compat.When(
        "epsilon_high null", lambda g: g.epsilon_high is None),
        "cispo caps the ratio weighting log pi at epsilon_high itself (ScaleRL: 5.0); left "
        "null it would be epsilon (0.2), below 1, so every ratio would be capped",
        used=lambda g: g.loss_type == "cispo", example={"grpo.loss_type": "cispo"}),
    *(compat.Refuse("grpo", key, compat.When(
        f"loss_type other than {owner}", lambda g, owner=owner: g.loss_type != owner),
        f"it is a setting of loss_type {owner}, which this run does not use",
        used=lambda g, key=key: getattr(g, key) != GRPOConfig.model_fields[key].default,
        example={f"grpo.{key}": 1.7})
      for owner, key in (("sapo", "sapo_temperature_pos"), ("sapo", "sapo_temperature_neg"),
                         ("vespo", "vespo_k_pos"), ("vespo", "vespo_lambda_pos"),
                         ("vespo", "vespo_k_neg"), ("vespo", "vespo_lambda_neg"))),
    compat.Refuse("grpo", "scale_rewards", compat.When(
        "multi_objective_aggregation normalize_then_sum",
        lambda g: g.multi_objective_aggregation == "normalize_then_sum"),
        "it normalises each function within its group and the sum over the batch itself",
        used=lambda g: g.scale_rewards != "group",
        example={"grpo.scale_rewards": "batch",
                 "grpo.multi_objective_aggregation": "normalize_then_sum"}),
    compat.Refuse("grpo", "delta", compat.When(
        "loss_type cispo, sapo or vespo", lambda g: g.loss_type in ("cispo", "sapo", "vespo")),
        "delta caps the ratio of the clipped surrogate, which these loss types replace",
        example={"grpo.delta": 1.5, "grpo.loss_type": "sapo"}),
    compat.Agree("grpo", ("delta", "epsilon_high"), _delta_above_the_clip,
                 example={"grpo.delta": 1.1}),
    compat.Refuse("grpo", "off_policy_mask_threshold", compat.When(
        "num_iterations 1 without use_vllm",
        lambda g: g.num_iterations == 1 and not g.use_vllm),
        "the completions are sampled from the weights being trained, so no completion is "
        "off-policy and nothing would be masked; use num_iterations > 1 (or use_vllm, whose "
        "sampler's log-probabilities it then compares with, as TRL does)",
        used=lambda g: g.off_policy_mask_threshold is not None,
        example={"grpo.off_policy_mask_threshold": 0.5}),
    compat.Refuse("grpo", "vllm_importance_sampling_mode", compat.When(
        "loss_type vespo", lambda g: g.loss_type == "vespo"),
        "vespo folds the token ratios into its completion weight itself; use token_truncate "
        "or token_mask (TRL refuses the sequence modes with vespo too)",
        used=lambda g: g.corrects_sampling
        and g.vllm_importance_sampling_mode.startswith("sequence"),
        example={"grpo.loss_type": "vespo", "grpo.use_vllm": True,
                 "grpo.vllm_server_base_url": "http://127.0.0.1:8000"}),
]
rollout_method(GRPOConfig, ROWS)
