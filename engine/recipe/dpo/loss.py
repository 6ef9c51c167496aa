"""The preference losses (DPO and its relatives) from sequence log-probabilities.

A micro-batch of b pairs is 2b rows, chosen sides first (engine.recipe.dpo.batches).
engine.objective.logprobs.sequence_logps turns one forward's logits into each row's summed
log-probability of its trained tokens and their count; `preference_loss` turns the policy's
(and the reference's) into per-pair losses and the reward statistics TRL logs. The formulas
are TRL's (DPOTrainer for sigmoid, ipo and robust; CPOTrainer's SimPO for simpo), and
tests/test_preference.py holds them to TRL's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the per-window statistics a DPO run logs, TRL's names, in PairStats.sums order
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
          "logps/chosen", "logps/rejected")


@dataclass
class PairLoss:
    losses: torch.Tensor  # [b], one per pair
    chosen_rewards: torch.Tensor  # [b], detached
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # [b], as the loss used them (length-averaged for simpo)
    rejected_logps: torch.Tensor

    def sums(self) -> torch.Tensor:
        """The LOGGED statistics summed over the pairs (float64, on the device)."""
        c, r = self.chosen_rewards, self.rejected_rewards
        return torch.stack([c.sum(), r.sum(), (c > r).float().sum(), (c - r).sum(),
                            self.chosen_logps.detach().sum(),
                            self.rejected_logps.detach().sum()]).double()


def preference_loss(dpo, logps: torch.Tensor, counts: torch.Tensor,
                    ref_logps: torch.Tensor | None) -> PairLoss:
    """Per-pair losses of `dpo.loss_type` from the 2b rows' summed log-probabilities `logps`
    (chosen rows first), their trained-token `counts`, and the reference's `ref_logps` (None
    for a reference-free loss)."""
    beta, eps = dpo.beta, dpo.label_smoothing
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = counts.clamp_min(1).to(logps.dtype).chunk(2)
    if dpo.loss_type == "simpo":  # reference-free: length-averaged log-probabilities
        chosen, rejected = chosen / n_chosen, rejected / n_rejected
        delta = chosen - rejected - dpo.simpo_gamma / beta
        losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
        return PairLoss(losses, beta * chosen.detach(), beta * rejected.detach(), chosen,
                        rejected)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if dpo.loss_type == "sigmoid":  # eps > 0: conservative DPO
        losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    elif dpo.loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * delta)
                  + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    elif dpo.loss_type == "ipo":  # the log-ratio margin per completion token (TRL's IPO)
        margin = chosen_ratio / n_chosen - rejected_ratio / n_rejected
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss_type {dpo.loss_type!r}")
    return PairLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(),
                    chosen, rejected)
