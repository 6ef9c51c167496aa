"""RLOO's loss, TRL 1.16's RLOOTrainer (`_compute_loss`): one probability ratio per completion,
the exp of its *summed* token log-ratios r = exp(sum_t log pi - sum_t log pi_old), clipped as
PPO clips it:

    loss_i = -min(r_i A_i, clip(r_i, 1 - eps, 1 + eps_high) A_i)

averaged over completions (the run's divisor counts them). No KL term: RLOO's KL is a penalty
on the reward (engine.recipe.rloo.advantages). The clip flags are per completion, so the
logged clip ratios are means over completions (grpo.loss.stat_means with a sequence-level
objective)."""

from __future__ import annotations

import torch

from engine.recipe.grpo.loss import TokenLosses


def sequence_losses(logps: torch.Tensor, old_logps: torch.Tensor | None,
                    advantages: torch.Tensor, mask: torch.Tensor, eps_low: float,
                    eps_high: float) -> TokenLosses:
    """[N, T] token log-probabilities (with their graph) -> per-completion losses ([N, 1])
    and clip flags. `old_logps` None: sampled from these very weights (num_iterations 1), so
    the ratio is 1 with the gradient of the summed log pi."""
    mask = mask.to(logps.dtype)
    summed = (logps * mask).sum(-1)
    old = summed.detach() if old_logps is None else (old_logps * mask).sum(-1)
    advantages = advantages.view(-1).to(summed.dtype)
    coef_1 = torch.exp(summed - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_sequence = -torch.min(coef_1 * advantages, coef_2 * advantages)
    low = (coef_1 < 1 - eps_low) & (advantages < 0)
    high = (coef_1 > 1 + eps_high) & (advantages > 0)
    return TokenLosses(per_sequence.unsqueeze(1), None, low.unsqueeze(1), high.unsqueeze(1))
