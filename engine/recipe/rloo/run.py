"""`training.type: rloo`: REINFORCE Leave-One-Out (TRL's RLOOTrainer) as a GRPO run with four
hooks replaced, so the rollout (generation, tools, environments, reward functions, seeding,
num_iterations, the sample table and the held-out rewards) is GRPO's, the same code:

- `keeps_old_logps`: the policy's log-probabilities at generation are kept with beta > 0 too
  (the KL penalty is measured against them, as TRL measures it);
- `advantage_inputs` / `compute_advantages`: each completion's summed log pi_old - log ref
  (and its token count, for the logged `kl`) is gathered with the rewards, and the
  advantages are leave-one-out (engine.recipe.rloo.advantages);
- `policy_loss`: the clipped ratio per completion, no KL term (engine.recipe.rloo.loss),
  averaged over completions (`averaged_over`).
"""

from __future__ import annotations

import torch

from engine.recipe.grpo.loss import Objective, TokenLosses
from engine.recipe.grpo.run import GRPORun
from engine.recipe.rloo.advantages import leave_one_out_advantages
from engine.recipe.rloo.loss import sequence_losses


class RLOORun(GRPORun):
    """An RLOO run: see the module docstring."""

    section = "rloo"

    def make_objective(self) -> Objective:
        """A sequence-level clipped ratio without a KL term: how the logged statistics are
        named and pooled (entropy over tokens, clip ratios over completions)."""
        g = self.g
        return Objective(loss_type="grpo", eps_low=g.epsilon, eps_high=g.clip_high, beta=0.0,
                         level="sequence")

    def rollout_stats(self) -> tuple[str, ...]:
        return ("kl",) if self.g.beta else ()

    def keeps_old_logps(self) -> bool:
        return self.g.num_iterations > 1 or self.g.beta > 0

    def advantage_inputs(self, batches: list[dict]) -> torch.Tensor:
        """[n, 2]: each completion's summed log pi_old - log ref and its token count (zeros
        with beta 0: no reference)."""
        columns = []
        for b in batches:
            mask = b["completion_mask"].float()
            if self.g.beta:
                kl = ((b["old_logps"] - b["ref_logps"]) * mask).sum(-1)
            else:
                kl = torch.zeros(mask.shape[0], device=mask.device)
            columns.append(torch.stack([kl, mask.sum(-1)], dim=1))
        return torch.cat(columns)

    def compute_advantages(self, per_func: torch.Tensor, inputs: torch.Tensor
                           ) -> tuple[torch.Tensor, dict]:
        g = self.g
        clip = tuple(g.reward_clip_range) if g.reward_clip_range else None
        adv, stats = leave_one_out_advantages(per_func, self.weights.to(per_func.device),
                                              g.num_generations, inputs[:, 0], g.beta, clip,
                                              g.normalize_advantages)
        if g.beta:  # TRL's: the per-token mean over every rank's completion tokens
            stats["kl"] = inputs[:, 0].double().sum() / inputs[:, 1].double().sum().clamp_min(1)
        return adv, stats

    def averaged_over(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.tensor(float(mask.shape[0]), device=mask.device)

    def policy_loss(self, logps: torch.Tensor, entropy: torch.Tensor, batch: dict
                    ) -> tuple[TokenLosses, torch.Tensor]:
        g = self.g
        old = batch.get("old_logps") if g.num_iterations > 1 else None
        losses = sequence_losses(logps, old, batch["advantages"], batch["completion_mask"],
                                 g.epsilon, g.clip_high)
        return losses, losses.per_token.sum()
