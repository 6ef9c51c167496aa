"""Log-probabilities of a row's trained tokens, the quantity every method past SFT compares
(DPO's pairs, and the next ones: KTO's single completions, GRPO's ratios and KL term).

log p(token) = logit(token) - logsumexp(logits): the full log-softmax is never stored.
"""

from __future__ import annotations

import torch

from engine.datapath.data import IGNORE_INDEX


def next_token_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[n, T-1], fp32: the log-probability of each row's next token `ids[:, 1:]` (an
    IGNORE_INDEX position reads token 0: mask it)."""
    ids = ids[:, 1:]
    logits = logits[:, :-1].float()
    picked = logits.gather(-1, ids.masked_fill(ids == IGNORE_INDEX, 0).unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's trained next tokens, their count), in fp32."""
    trained = labels[:, 1:] != IGNORE_INDEX
    per_token = next_token_logps(logits, labels) * trained
    return per_token.sum(-1), trained.sum(-1)
