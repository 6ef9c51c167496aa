"""RLOO's advantages, TRL 1.16's RLOOTrainer (`_generate_and_score_completions`) formula:

- a completion's reward is the weighted sum of its functions' rewards (NaN, a function's None,
  left out; a completion no function scored is NaN and leaves the baseline), clamped to
  `clip_range` when given, minus `beta` times its KL estimate (the completion's summed
  log pi_old - log ref: the first-order estimate, a penalty on the reward);
- its baseline is the mean reward of the *other* scored completions of its prompt (the
  leave-one-out mean), and its advantage the difference;
- `normalize`: the advantages minus their mean over the batch, over their std + 1e-4;
- a NaN advantage (unscored, or the only scored completion of its group) becomes 0.

The statistics are TRL's: the raw weighted rewards' `reward` and `reward_std` (neither clamped
nor penalised), per function `rewards/<i>/mean` and `/std`, and `frac_reward_zero_std` the share
of groups whose penalised rewards have no spread. Nothing is read back to the host.
"""

from __future__ import annotations

import torch

from engine.recipe.grpo.advantages import EPS, nanstd, reward_stats, weighted_rewards


def leave_one_out_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor,
                             num_generations: int, kl: torch.Tensor | None = None,
                             beta: float = 0.0, clip_range: tuple[float, float] | None = None,
                             normalize: bool = False) -> tuple[torch.Tensor, dict]:
    """[N, F] rewards (NaN: not scored), [F] weights, [N] summed KL estimates (or None) ->
    ([N] advantages, logged statistics). N is a whole number of groups of `num_generations`
    consecutive completions."""
    n = rewards_per_func.shape[0]
    if num_generations < 2 or n % num_generations:
        raise ValueError(f"{n} completions are not whole groups of {num_generations} >= 2")
    raw = weighted_rewards(rewards_per_func, weights)
    rewards = raw if clip_range is None else raw.clamp(min=clip_range[0], max=clip_range[1])
    if beta and kl is not None:
        rewards = rewards - beta * kl.to(rewards.dtype)
    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    baselines = ((total - grouped) / (scored - 1)).view(-1)
    advantages = rewards - baselines
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + EPS)
    return torch.nan_to_num(advantages, nan=0.0), reward_stats(rewards_per_func, raw, std)
