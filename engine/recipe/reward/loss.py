"""A reward model's loss: Bradley-Terry on each pair's two scalar rewards.

A micro-batch of b pairs is 2b rows, chosen sides first (engine.recipe.dpo.batches); the
one-output head gives each row its reward, so the pair's loss is
-log sigmoid(r_chosen - r_rejected - margin) (margin: the pair's `margin` column, else 0),
plus `center_rewards_coefficient` x (r_chosen + r_rejected)^2, whose mean over the pairs is
TRL's centring term. The step's loss is the mean over its pairs, as TRL's RewardTrainer's is
over its batch; tests/test_reward.py holds both to TRL's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the per-window statistics a reward run logs, in PairRewards.sums order: TRL's names
#: (accuracy, margin, mean_reward) and each side's mean reward (DPO's names for them)
LOGGED = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")


@dataclass
class PairRewards:
    losses: torch.Tensor  # [b], one per pair
    chosen: torch.Tensor  # [b], detached
    rejected: torch.Tensor

    def sums(self) -> torch.Tensor:
        """The LOGGED statistics summed over the pairs (float64, on the device): divided by
        the pair count they are TRL's means (mean_reward: over both sides of every pair)."""
        c, r = self.chosen.double(), self.rejected.double()
        return torch.stack([(c > r).double().sum(), (c - r).sum(), ((c + r) / 2).sum(),
                            c.sum(), r.sum()])


def bradley_terry(rewards: torch.Tensor, margin: torch.Tensor | None,
                  center_coefficient: float | None) -> PairRewards:
    """Per-pair losses from the 2b rows' rewards `rewards` ([2b] or [2b, 1], chosen rows
    first), each pair's `margin` ([b]; None: 0) and the centring coefficient (None: off)."""
    chosen, rejected = rewards.reshape(-1).float().chunk(2)
    delta = chosen - rejected
    if margin is not None:
        delta = delta - margin.to(delta.dtype)
    losses = -F.logsigmoid(delta)
    if center_coefficient is not None:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return PairRewards(losses, chosen.detach(), rejected.detach())
