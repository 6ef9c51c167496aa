"""GRPO's advantages from the reward functions' scores, TRL 1.16's `sum_then_normalize`
(GRPOTrainer._generate_and_score_completions) line for line:

- a completion's reward is the weighted sum of its functions' rewards, NaN (a function's None)
  left out; a completion no function scored (all NaN) has a NaN reward, left out of the
  statistics below;
- the baseline is its group's mean reward (the num_generations completions of one prompt,
  consecutive rows);
- `scale`: 'group' divides by the group's std, 'batch' by the whole batch's, 'none' by
  nothing; the std is TRL's nanstd (Bessel-corrected, NaN for fewer than two values) and the
  divisor std + 1e-4;
- a NaN advantage (an unscored completion, a group with one scored completion) becomes 0.

`aggregation` normalize_then_sum (TRL's `multi_objective_aggregation`, GDPO): each function's
rewards are normalised within their group first (so a function with a large range does not
drown the others), the weighted sum is then normalised over the whole batch; `scale` does not
apply (the config refuses another than group).

The statistics are TRL's logged metrics, 0-d tensors on the rewards' device: `reward` and
`reward_std` over the batch, `frac_reward_zero_std` (the fraction of completions whose std, as
`scale` measures it, is zero), and per function `rewards/<i>/mean` and `rewards/<i>/std`
(keyed by the function's index; the run names them). Nothing here reads a value back to the
host, so the rewards may live on the accelerator without a sync.
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")
EPS = 1e-4  # TRL's, added to the std


def nanstd(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd (trl.trainer.utils): the std of the non-NaN values, Bessel-corrected; NaN
    where fewer than two values are left."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, torch.nan))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale: str, aggregation: str = "sum_then_normalize"
                     ) -> tuple[torch.Tensor, dict]:
    """[N, F] rewards (NaN: not scored), [F] weights -> ([N] advantages, logged statistics).
    N is a whole number of groups of `num_generations` consecutive completions."""
    scale = {True: "group", False: "none"}.get(scale, scale)  # TRL's bool spelling
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: one of {', '.join(SCALES)}")
    n, funcs = rewards_per_func.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{n} completions are not whole groups of {num_generations}")
    if weights.shape != (funcs,):
        raise ValueError(f"{tuple(weights.shape)} weights for {funcs} reward functions")
    weights = weights.to(device=rewards_per_func.device, dtype=rewards_per_func.dtype)

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r}: one of {', '.join(AGGREGATIONS)}")

    unscored = torch.isnan(rewards_per_func).all(dim=1)

    def weighted(per_func: torch.Tensor) -> torch.Tensor:
        return weighted_rewards(per_func, weights, unscored)

    rewards = weighted(rewards_per_func)
    if aggregation == "normalize_then_sum":
        return _normalize_then_sum(rewards_per_func, rewards, weighted, num_generations)
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # group, and none (whose std only counts zero-std groups)
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + EPS)
    return torch.nan_to_num(advantages, nan=0.0), reward_stats(rewards_per_func, rewards, std)


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor,
                     unscored: torch.Tensor | None = None) -> torch.Tensor:
    """[N] the weighted sum of each completion's rewards, a function's NaN left out; NaN for
    a completion no function scored (`unscored`: which, default those of `per_func`)."""
    if unscored is None:
        unscored = torch.isnan(per_func).all(dim=1)
    weights = weights.to(device=per_func.device, dtype=per_func.dtype)
    summed = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    return torch.where(unscored, torch.full_like(summed, torch.nan), summed)


def _normalize_then_sum(rewards_per_func: torch.Tensor, rewards: torch.Tensor, weighted,
                        num_generations: int) -> tuple[torch.Tensor, dict]:
    n, funcs = rewards_per_func.shape
    grouped = rewards_per_func.view(-1, num_generations, funcs)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = (nanstd(grouped, dim=1).unsqueeze(1) if num_generations > 1
             else torch.zeros_like(mean_k))
    normalised = weighted(((grouped - mean_k) / (std_k + EPS)).view(-1, funcs))
    std = nanstd(normalised).expand_as(normalised) if n > 1 else torch.zeros_like(normalised)
    advantages = (normalised - torch.nanmean(normalised)) / (std + EPS)
    return torch.nan_to_num(advantages, nan=0.0), reward_stats(rewards_per_func, rewards, std)


def reward_stats(rewards_per_func: torch.Tensor, rewards: torch.Tensor, std: torch.Tensor
                 ) -> dict:
    """TRL's logged statistics of the raw weighted rewards; `std`: the spreads whose zeros
    frac_reward_zero_std counts (GRPO's, per completion, the one the advantages were divided
    by; RLOO's, per group, of its penalised rewards)."""
    stats = {"reward": torch.nanmean(rewards), "reward_std": nanstd(rewards),
             "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean()}
    for i in range(rewards_per_func.shape[1]):
        stats[f"rewards/{i}/mean"] = torch.nanmean(rewards_per_func[:, i])
        stats[f"rewards/{i}/std"] = nanstd(rewards_per_func[:, i])
    return stats
