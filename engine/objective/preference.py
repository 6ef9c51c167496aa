"""The preference losses (DPO and its relatives) from sequence log-probabilities.

A micro-batch of b pairs is 2b rows, chosen sides first (engine.datapath.data.collate_pairs).
`sequence_logps` turns one forward's logits into each row's summed log-probability of its
trained tokens and their count; `preference_loss` turns the policy's (and the reference's)
into per-pair losses and the reward statistics TRL logs. The formulas are TRL's (DPOTrainer for
sigmoid, ipo and robust; CPOTrainer's SimPO for simpo), and tests/test_preference.py holds them
to TRL's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.datapath.data import IGNORE_INDEX

#: the per-window statistics a DPO run logs, TRL's names, in PairStats.sums order
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
          "logps/chosen", "logps/rejected")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's trained next tokens, their count), in fp32.
    log p(token) = logit(token) - logsumexp(logits): the full log-softmax is never stored."""
    labels = labels[:, 1:]
    logits = logits[:, :-1].float()
    trained = labels != IGNORE_INDEX
    picked = logits.gather(-1, labels.masked_fill(~trained, 0).unsqueeze(-1)).squeeze(-1)
    per_token = (picked - torch.logsumexp(logits, dim=-1)) * trained
    return per_token.sum(-1), trained.sum(-1)


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


def ranking_scores(scored: torch.Tensor, reference: torch.Tensor, dpo) -> dict[str, float]:
    """How a model ranks held-out pairs, from `pair_log_probs` rows (chosen, rejected, their
    token counts) of the model and of the `reference` (the base model; for the base itself,
    the same rows). Ties count half.
    - preference_accuracy: the share of pairs whose chosen side gets the higher implicit
      reward, the one `dpo.loss_type` trains: beta x (log pi - log pi_ref), or for simpo beta x
      the length-averaged log pi. The base is its own reference: every pair ties, 0.5.
    - reward_margin: the mean implicit reward margin (chosen - rejected).
    - likelihood_accuracy, logp_margin: the same from the model's own summed log-probabilities,
      no reference (how likely it finds each side)."""
    if len(scored) == 0:
        return {}
    chosen, rejected, n_chosen, n_rejected = scored.unbind(1)
    own = chosen - rejected
    if dpo.loss_type == "simpo":
        reward = dpo.beta * (chosen / n_chosen.clamp_min(1) - rejected / n_rejected.clamp_min(1))
    else:
        reward = dpo.beta * (own - (reference[:, 0] - reference[:, 1]))

    def ranked(margin: torch.Tensor) -> float:
        return float(((margin > 0).double() + 0.5 * (margin == 0).double()).mean())

    return {"preference_accuracy": ranked(reward), "reward_margin": float(reward.mean()),
            "likelihood_accuracy": ranked(own), "logp_margin": float(own.mean())}
