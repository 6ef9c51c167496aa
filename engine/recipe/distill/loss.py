"""The distillation loss: TRL GKD's generalised Jensen-Shannon divergence per trained token,
computed a chunk of target rows at a time, so the whole batch's full-vocabulary logits are
never held at once (as engine.objective.loss.ChunkedLoss does for the cross entropy).

Per trained token, with s and t the student's and the teacher's log-probabilities of
logits / temperature (Agarwal et al. 2024, eq. 1; TRL's `generalized_jsd_loss`):

- beta 0: KL(t || s) = sum_v p_t (log p_t - log p_s), the forward KL;
- beta 1: KL(s || t), the reverse KL;
- otherwise, with the mixture m = beta p_t + (1 - beta) p_s:
  beta KL(t || m) + (1 - beta) KL(s || m).

The same sums over a subset of the vocabulary give the offline loss: the teacher's `top_k`
ids and log-probabilities (the teacher stage's columns) against the student's log-softmax over
the full vocabulary gathered at those ids. With top_k the vocabulary size the two are the
same. TRL's reduction is the sum over the trained tokens divided by their number; here the
functions return the sum (the loop divides by the step's target count over micro-batches and
ranks, as for the cross entropy), and `alpha` mixes in the data's cross entropy per token:
(1 - alpha) x divergence + alpha x cross entropy (at temperature 1).

The student's output layer is the model's own module, swapped while `computing(...)` is open,
as ChunkedLoss swaps it: the model's forward returns the summed loss, so DDP and FSDP2 see an
ordinary forward. Each chunk is checkpointed when there is more than one, so one chunk's fp32
logits (and the teacher's) live at a time, forward and backward.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from engine.modeling.model import base_model
from engine.objective.loss import target_rows
from finetune.errors import PipelineError


def divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """[rows]: the generalised JSD of each row from the student's and the teacher's
    log-probabilities over the same ids ([rows, ids], the full vocabulary or the teacher's
    top k); `beta` as TRL's GKD."""
    if beta == 0:
        terms = F.kl_div(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        terms = F.kl_div(teacher, student, reduction="none", log_target=True)
    else:
        mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta),
                                               teacher + math.log(beta)]), dim=0)
        terms = (beta * F.kl_div(mixture, teacher, reduction="none", log_target=True)
                 + (1 - beta) * F.kl_div(mixture, student, reduction="none", log_target=True))
    return terms.sum(-1)


def log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log-softmax of logits / temperature."""
    return F.log_softmax(logits.float() / temperature, dim=-1)


@dataclass
class Teacher:
    """The teacher's side of the trained tokens, in target-row order (`target_rows`): either
    its top-k ids and log-probabilities (offline: [rows, k] each), or its last hidden states
    and output layer (on-policy: [rows, hidden]; the chunk's logits are made when needed)."""

    ids: torch.Tensor | None = None
    logps: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def chunk(self, start: int, end: int, temperature: float):
        """(ids or None, log-probabilities) of rows [start, end)."""
        if self.hidden is not None:
            with torch.no_grad():
                return None, log_probs(self.head(self.hidden[start:end]), temperature)
        return self.ids[start:end], self.logps[start:end].float()


@dataclass(frozen=True)
class Weights:
    beta: float
    temperature: float
    alpha: float = 0.0


def chunk_loss(head_forward, flat: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor,
               teacher_ids: torch.Tensor | None, teacher_logps: torch.Tensor,
               w: Weights) -> torch.Tensor:
    """The summed loss of one chunk of target rows: the student's logits of these rows only,
    their divergence from the teacher's, and alpha x their cross entropy."""
    logits = head_forward(flat.index_select(0, rows)).float()
    student = log_probs(logits, w.temperature)
    if teacher_ids is not None:
        student = student.gather(-1, teacher_ids)
    total = divergence(student, teacher_logps, w.beta).sum()
    if w.alpha:
        total = (1 - w.alpha) * total + w.alpha * F.cross_entropy(logits, labels,
                                                                  reduction="sum")
    return total


def chunked_sum(head_forward, flat: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor,
                teacher: Teacher, w: Weights, chunk_tokens: int | None) -> torch.Tensor:
    """The summed loss over all target rows, `chunk_tokens` at a time (None: at once),
    each chunk checkpointed when there are several."""
    n = len(rows)
    size = chunk_tokens or max(n, 1)
    spans = [(s, min(s + size, n)) for s in range(0, n, size)]
    if not spans:  # nothing trained: a zero that still uses the head (DDP wants it)
        return head_forward(flat[:1]).float().sum() * 0
    total = None
    for start, end in spans:
        ids, logps = teacher.chunk(start, end, w.temperature)
        args = (head_forward, flat, rows[start:end], labels[start:end], ids, logps, w)
        part = (checkpoint(chunk_loss, *args, use_reentrant=False) if len(spans) > 1
                else chunk_loss(*args))
        total = part if total is None else total + part
    return total


class DistillLoss:
    """Installed on the student's output layer: while `computing(labels, teacher)` is open,
    the model's forward returns the summed distillation loss of `labels`' target rows (see
    the module docstring); otherwise (evaluation, generation) the ordinary head."""

    def __init__(self, model, weights: Weights, chunk_tokens: int | None,
                 device: torch.device):
        self.weights, self.chunk_tokens, self.device = weights, chunk_tokens, device
        head = base_model(model).get_output_embeddings()
        if head is None:
            raise PipelineError(f"training.type distill: {type(base_model(model)).__name__} "
                                "has no output embeddings to distill through")
        self._pending = None
        original = head.forward
        loss = self

        @torch.compiler.disable
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            pending = loss._pending
            if pending is None:
                return original(hidden)
            rows, labels, teacher = pending
            total = chunked_sum(original, hidden.reshape(-1, hidden.shape[-1]), rows, labels,
                                teacher, loss.weights, loss.chunk_tokens)
            return total.reshape(1, 1, 1)

        head.forward = forward

    @contextlib.contextmanager
    def computing(self, host_labels: torch.Tensor, teacher: Teacher):
        """While open, the model's forward returns the loss of `host_labels` (a CPU tensor)
        against `teacher` (its rows in the same order)."""
        rows, targets = target_rows(host_labels)
        self._pending = (rows.to(self.device, non_blocking=True),
                         targets.to(self.device, non_blocking=True), teacher)
        try:
            yield
        finally:
            self._pending = None

    @staticmethod
    def loss_sum(output) -> torch.Tensor:
        return output.logits.reshape(())
