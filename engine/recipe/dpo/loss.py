"""The preference losses (DPO and its relatives) from sequence log-probabilities.

A micro-batch of b pairs is 2b rows, chosen sides first (engine.recipe.dpo.batches).
engine.objective.logprobs.sequence_logps turns one forward's logits into each row's summed
log-probability of its trained tokens and their count; `preference_loss` turns the policy's
(and the reference's) into per-pair losses and the reward statistics TRL logs. The formulas
are TRL's (DPOTrainer for sigmoid, ipo and robust; CPOTrainer's SimPO for simpo), and
orpo is ORPOTrainer's (trl.experimental.orpo): the chosen side's NLL plus beta x the
odds-ratio term, on length-averaged log-probabilities, reference-free. tests/test_preference.py
holds them to TRL's own numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the per-window statistics a DPO run logs, TRL's names, in PairStats.sums order
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
          "logps/chosen", "logps/rejected")
#: orpo logs these next to LOGGED (TRL's ORPOTrainer's names), in PairLoss.more's order
ORPO_LOGGED = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def logged(dpo) -> tuple[str, ...]:
    """The statistics a run with this dpo section logs, in PairLoss.sums order."""
    return LOGGED + ORPO_LOGGED if dpo.loss_type == "orpo" else LOGGED


@dataclass
class PairLoss:
    losses: torch.Tensor  # [b], one per pair
    chosen_rewards: torch.Tensor  # [b], detached
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # [b], as the loss used them (length-averaged for simpo)
    rejected_logps: torch.Tensor
    more: tuple[torch.Tensor, ...] = ()  # [b] each, detached: orpo's ORPO_LOGGED

    def sums(self) -> torch.Tensor:
        """The `logged` statistics summed over the pairs (float64, on the device)."""
        c, r = self.chosen_rewards, self.rejected_rewards
        return torch.stack([c.sum(), r.sum(), (c > r).float().sum(), (c - r).sum(),
                            self.chosen_logps.detach().sum(),
                            self.rejected_logps.detach().sum(),
                            *(x.sum() for x in self.more)]).double()

    def first(self, n: int) -> "PairLoss":
        """The first n pairs' (the rest: padding pairs of an uneven last share)."""
        return PairLoss(*(x[:n] for x in (self.losses, self.chosen_rewards,
                                          self.rejected_rewards, self.chosen_logps,
                                          self.rejected_logps)),
                        tuple(x[:n] for x in self.more))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's switch at -log 2)."""
    near_zero = x > -math.log(2)
    return torch.where(near_zero, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(beta: float, chosen: torch.Tensor, rejected: torch.Tensor,
              nll: torch.Tensor) -> PairLoss:
    """ORPO per pair: the chosen side's `nll` minus beta x log sigmoid of the log odds ratio
    of the length-averaged log-probabilities `chosen` and `rejected` (odds = p / (1 - p))."""
    chosen, rejected = chosen.float(), rejected.float()
    log_odds = chosen - rejected - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    return PairLoss(nll - beta * ratio, beta * chosen.detach(), beta * rejected.detach(),
                    chosen, rejected, (nll.detach(), ratio.detach(), log_odds.detach()))


def preference_loss(dpo, logps: torch.Tensor, counts: torch.Tensor,
                    ref_logps: torch.Tensor | None, nll: torch.Tensor | None = None
                    ) -> PairLoss:
    """Per-pair losses of `dpo.loss_type` from the 2b rows' summed log-probabilities `logps`
    (chosen rows first), their trained-token `counts`, and the reference's `ref_logps` (None
    for a reference-free loss); orpo: `nll`, each chosen side's NLL ([b], `chosen_nll`)."""
    beta, eps = dpo.beta, dpo.label_smoothing
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = counts.clamp_min(1).to(logps.dtype).chunk(2)
    if dpo.loss_type == "simpo":  # reference-free: length-averaged log-probabilities
        chosen, rejected = chosen / n_chosen, rejected / n_rejected
        delta = chosen - rejected - dpo.simpo_gamma / beta
        losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
        return PairLoss(losses, beta * chosen.detach(), beta * rejected.detach(), chosen,
                        rejected)
    if dpo.loss_type == "orpo":
        return orpo_loss(beta, chosen / n_chosen, rejected / n_rejected, nll)
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


def chosen_nll(per_token: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[b]: each chosen side's mean NLL over all its next tokens, prompt included, as TRL's
    ORPO (and the ORPO authors' code) trains it: `per_token` [2b, T-1] are every row's
    next-token log-probabilities (engine.objective.logprobs.next_token_logps), chosen first."""
    per_token = per_token[: len(per_token) // 2]
    real = attention_mask[: len(per_token), 1:].to(per_token.dtype)
    return -(per_token * real).sum(-1) / real.sum(-1).clamp_min(1)
