"""The KTO loss from sequence log-probabilities (TRL's KTOTrainer `loss_type: kto`).

Each row's implicit reward is beta x (log pi - log pi_ref) of its completion. A desirable row's
loss is desirable_weight x (1 - sigmoid(reward - beta x KL)), an undesirable row's
undesirable_weight x (1 - sigmoid(beta x KL - reward)); KL is the batch's estimate of the
policy's divergence from the reference, the mean log-ratio of the mismatched rows
(engine.recipe.kto.batches), detached and clamped at 0. tests/test_kto.py holds the loss and
the statistics to TRL's own numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the per-window statistics a KTO run logs, TRL's names
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
          "logps/rejected", "kl")
#: what a window sums to make them (KTOLoss.sums order): TRL's means are per label
SUMS = ("rewards/chosen_sum", "rewards/rejected_sum", "logps/chosen_sum", "logps/rejected_sum",
        "count/chosen", "count/rejected", "kl_sum")


@dataclass
class KTOLoss:
    losses: torch.Tensor  # [b], weighted, one per row
    rewards: torch.Tensor  # [b], detached
    logps: torch.Tensor  # [b]
    desirable: torch.Tensor  # [b] bool
    kl: torch.Tensor  # scalar, detached

    def sums(self) -> torch.Tensor:
        """The SUMS over the rows (float64, on the device); the KL once per row, so the
        window's row-weighted mean is the step's estimate."""
        d = self.desirable.to(torch.float64)
        u = 1 - d
        r, lp = self.rewards.double(), self.logps.detach().double()
        return torch.stack([(r * d).sum(), (r * u).sum(), (lp * d).sum(), (lp * u).sum(),
                            d.sum(), u.sum(), self.kl.double() * len(d)])


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """[sum of the mismatched rows' log-ratios, their count] (float64), to be summed over
    micro-batches and ranks before `clamped_mean`."""
    diff = (logps - ref_logps).detach().double()
    return torch.stack([diff.sum(), torch.tensor(float(len(diff)), dtype=torch.float64,
                                                 device=diff.device)])


def clamped_mean(sums: torch.Tensor) -> torch.Tensor:
    """The KL estimate from `kl_estimate` sums: their mean, clamped at 0 (as TRL does)."""
    return (sums[0] / sums[1].clamp_min(1)).clamp_min(0)


def kto_loss(kto, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor) -> KTOLoss:
    """Per-row losses of the `kto` section's objective from the rows' summed log-probabilities
    of the policy and the reference, their labels and the KL estimate."""
    ratio = logps - ref_logps
    kl = kl.to(ratio.dtype)
    desirable_loss = kto.desirable_weight * (1 - torch.sigmoid(kto.beta * (ratio - kl)))
    undesirable_loss = kto.undesirable_weight * (1 - torch.sigmoid(kto.beta * (kl - ratio)))
    losses = torch.where(desirable, desirable_loss, undesirable_loss)
    return KTOLoss(losses, kto.beta * ratio.detach(), logps, desirable, kl.detach())


def window_means(sums: dict[str, float]) -> dict[str, float]:
    """The logged statistics from a window's SUMS (all ranks): rewards and log-probabilities
    averaged per label (left out when the window had no row of that label, as TRL does), the
    margin when both labels were seen, the KL per row."""
    out = {}
    rows = sums["count/chosen"] + sums["count/rejected"]
    for side in ("chosen", "rejected"):
        n = sums[f"count/{side}"]
        if n > 0:
            out[f"rewards/{side}"] = sums[f"rewards/{side}_sum"] / n
            out[f"logps/{side}"] = sums[f"logps/{side}_sum"] / n
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["kl"] = sums["kl_sum"] / max(rows, 1)
    return out
