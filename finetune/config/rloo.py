"""The `rloo` section: REINFORCE Leave-One-Out (`training.type: rloo`, Ahmadian et al. 2024),
with TRL's RLOOConfig names and meanings. The rollout's settings are every rollout method's
(finetune/config/rollout.py); RLOO differs from GRPO in three places, all TRL's:

- the advantage of a completion is its reward minus the mean reward of the *other*
  completions of its prompt (the leave-one-out baseline), unscaled unless
  `normalize_advantages` (then over the whole batch);
- the KL to the reference is a penalty on the reward, `beta` times the completion's summed
  first-order log-ratio log pi_old - log ref, not a term of the loss;
- the probability ratio is one per completion, the exp of its *summed* token log-ratios,
  clipped to [1 - epsilon, 1 + epsilon_high], and the loss is averaged over completions.

engine/recipe/rloo/ is its room (the advantages, the loss and the run, a GRPO run with these
three hooks replaced).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import field_validator

from finetune.config import compat
from finetune.config.rollout import RolloutConfig, rollout_method
from finetune.config.section import Field


class RLOOConfig(RolloutConfig):
    """REINFORCE with a leave-one-out baseline: each completion is pushed up by how much its
    reward beats the mean of its siblings'."""

    SCOPE: ClassVar[str] = "rloo"

    num_generations: int = Field(
        2, ge=2, fingerprint=True,
        description="Completions sampled per prompt (TRL's RLOO default 2); each one's "
        "baseline is the mean reward of the others, so it needs at least 2.")
    beta: float = Field(
        0.05, ge=0, fingerprint=True,
        description="Weight of the KL penalty on the reward: beta times the completion's "
        "summed log pi_old - log ref (the first-order estimate, TRL's RLOO) is subtracted "
        "from its reward before the baseline; 0 loads no reference.")
    normalize_advantages: bool = Field(
        False, fingerprint=True,
        description="Normalise the advantages over the whole batch (all ranks): minus "
        "their mean, over their std + 1e-4.")
    reward_clip_range: tuple[float, float] | None = Field(
        None, fingerprint=True,
        description="Clamp each completion's weighted reward to [low, high] before the KL "
        "penalty and the baseline (null: off).")

    vllm_importance_sampling_correction: bool = Field(
        False, fingerprint=True,
        description="Off for rloo, and refused with use_vllm: TRL's RLOOTrainer applies no "
        "importance-sampling correction (its loss is one clipped ratio per completion), so "
        "the server's completions are trained on as they are. The mismatch is GRPO's to "
        "correct (grpo.vllm_importance_sampling_correction).")

    @field_validator("reward_clip_range")
    @classmethod
    def _ordered(cls, value):
        if value is not None and value[0] > value[1]:
            raise ValueError(f"[{value[0]}, {value[1]}] is not a range: low above high")
        return value


#: rloo's own rows of the compatibility table (the shared ones are rollout_method's)
ROWS: list[compat.Rule] = [
    compat.Refuse("rloo", "vllm_importance_sampling_correction", compat.When(
        "use_vllm true", lambda g: g.use_vllm),
        "TRL's RLOOTrainer has no importance-sampling correction for its one ratio per "
        "completion; set it false (training.type grpo corrects the sampler's mismatch)",
        example={"training.type": "rloo", "data.dataset_type": "prompt",
                 "registry.gate_metric": "eval.reward", "rloo.use_vllm": True,
                 "rloo.vllm_server_base_url": "http://127.0.0.1:8000",
                 "rloo.vllm_importance_sampling_correction": True}),
]
rollout_method(RLOOConfig, ROWS)
