"""Log-probabilities of a row's trained tokens, the quantity every method past SFT compares
(DPO's pairs, and the next ones: KTO's single completions, GRPO's ratios and KL term).

log p(token) = logit(token) - logsumexp(logits): the full log-softmax is never stored.
"""

from __future__ import annotations

import torch

from engine.datapath.data import IGNORE_INDEX


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's trained next tokens, their count), in fp32."""
    labels = labels[:, 1:]
    logits = logits[:, :-1].float()
    trained = labels != IGNORE_INDEX
    picked = logits.gather(-1, labels.masked_fill(~trained, 0).unsqueeze(-1)).squeeze(-1)
    per_token = (picked - torch.logsumexp(logits, dim=-1)) * trained
    return per_token.sum(-1), trained.sum(-1)
