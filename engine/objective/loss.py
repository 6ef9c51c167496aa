"""The training loss without the full fp32 logits.

At a 50k-token vocabulary the output layer makes a step's largest tensors: logits of tokens x
vocabulary, upcast to fp32 for the cross entropy, with a log-softmax and a gradient of the same
size (~0.8 GB each for 4k tokens). With completion-only labels most of those rows are ignored
anyway. `ChunkedLoss` applies the output layer (the model's own module, LoRA included) only to
the hidden states of positions that predict a target, at most `chunk_tokens` rows at a time;
with more than one chunk each is checkpointed, so one chunk's fp32 logits live at a time,
forward and backward. The loss equals the full computation up to summation order.

The head stays the model's own module and runs inside the model's forward: while a
`computing(labels)` block is open its `forward` (swapped on the instance) returns the summed
loss instead of logits, so DDP, FSDP2 and their hooks see an ordinary forward; under
torch.compile the head runs eager (a graph break), the decoder compiled. A model whose forward
transforms the logits after the output layer (Gemma's soft-capping, Cohere's logit scale) would
get another loss: a probe at start-up compares both ways and refuses with one line.

The rows are found on the host from the CPU labels (no device sync) and copied once per
micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from engine.datapath.data import IGNORE_INDEX, token_loss_sum
from engine.modeling.model import base_model
from finetune.errors import PipelineError


@dataclass
class PendingTargets:
    rows: torch.Tensor  # flat positions (batch x tokens) whose next token is a target
    labels: torch.Tensor  # those targets
    chunks: list[tuple[int, int]]  # [start, end) of each chunk over the rows (host ints)


def target_rows(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions, targets) of the next-token loss of a (rows, tokens) CPU label tensor."""
    shifted = labels[:, 1:]
    row, col = (shifted != IGNORE_INDEX).nonzero(as_tuple=True)
    return row * labels.shape[1] + col, shifted[row, col]


def _chunk_loss(head_forward, flat: torch.Tensor, rows: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    logits = head_forward(flat.index_select(0, rows)).float()
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum")


def head_loss_sum(head_forward, hidden: torch.Tensor, labels: torch.Tensor,
                  chunk_tokens: int | None) -> torch.Tensor:
    """The summed next-token loss of `labels` from the last hidden states, the output layer
    applied to the target rows `chunk_tokens` at a time (None: all at once): never the full
    fp32 logits of every position. For a module that holds the head itself (a pipeline's
    last stage); ChunkedLoss installs the same on a whole model."""
    rows, targets = target_rows(labels)
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows, targets = rows.to(flat.device), targets.to(flat.device)
    size = chunk_tokens or max(len(rows), 1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, max(len(rows), 1), size):
        total = total + _chunk_loss(head_forward, flat, rows[start:start + size],
                                    targets[start:start + size])
    return total


class FullLoss:
    """The plain way: the model's logits, upcast, one cross entropy."""

    name = "full"
    #: (logits, labels) -> summed loss, for evaluation (the head's ordinary forward)
    eval_loss_sum = staticmethod(token_loss_sum)

    def computing(self, labels: torch.Tensor):
        return contextlib.nullcontext()

    def loss_sum(self, output, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(output.logits, labels)


class ChunkedLoss:
    """Installed on a model's output layer; see the module docstring."""

    name = "chunked"
    eval_loss_sum = staticmethod(token_loss_sum)

    def __init__(self, model, chunk_tokens: int, device: torch.device):
        self.chunk_tokens, self.device = chunk_tokens, device
        self._pending: PendingTargets | None = None
        head = base_model(model).get_output_embeddings()
        if head is None:
            raise PipelineError(
                f"training.loss_chunk_tokens: {type(base_model(model)).__name__} has no output "
                "embeddings to chunk; set training.loss_chunk_tokens: null"
            )
        self.head = head
        original = head.forward
        loss = self

        @torch.compiler.disable  # the decoder compiles; the chunk loop runs eager
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            pending = loss._pending
            if pending is None:  # evaluation, generation: the ordinary head
                return original(hidden)
            return loss._summed(original, hidden.reshape(-1, hidden.shape[-1]), pending)

        head.forward = forward

    def _summed(self, head_forward, flat: torch.Tensor, t: PendingTargets) -> torch.Tensor:
        if not t.chunks:  # nothing to predict: a zero that still uses the head (DDP wants it)
            return (_chunk_loss(head_forward, flat, t.rows.new_zeros(1), t.labels.new_zeros(1))
                    * 0).reshape(1, 1, 1)
        total = None
        for start, end in t.chunks:
            args = (head_forward, flat, t.rows[start:end], t.labels[start:end])
            part = (checkpoint(_chunk_loss, *args, use_reentrant=False) if len(t.chunks) > 1
                    else _chunk_loss(*args))
            total = part if total is None else total + part
        return total.reshape(1, 1, 1)

    @contextlib.contextmanager
    def computing(self, labels: torch.Tensor):
        """While open, the model's forward returns the loss of `labels` (a CPU tensor)."""
        rows, targets = target_rows(labels)
        n, size = len(rows), self.chunk_tokens
        self._pending = PendingTargets(rows.to(self.device, non_blocking=True),
                                 targets.to(self.device, non_blocking=True),
                                 [(s, min(s + size, n)) for s in range(0, n, size)])
        try:
            yield
        finally:
            self._pending = None

    def loss_sum(self, output, labels: torch.Tensor) -> torch.Tensor:
        return output.logits.reshape(())


class UserLoss(FullLoss):
    """training.compute_loss_func, called as HF's Trainer calls it, fn(outputs, labels,
    num_items_in_batch=...), with num_items_in_batch=1: a function written for HF divides its
    summed loss by num_items_in_batch, so it returns the sum here and the loop divides by the
    step's target count across micro-batches and ranks, as for the built-in loss."""

    name = "user"

    def __init__(self, fn):
        self.fn = fn
        self.eval_loss_sum = lambda logits, labels: fn(_Outputs(logits), labels,
                                                       num_items_in_batch=1)

    def loss_sum(self, output, labels: torch.Tensor) -> torch.Tensor:
        loss = self.fn(output, labels, num_items_in_batch=1)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise PipelineError("training.compute_loss_func must return a scalar tensor (got "
                                f"{type(loss).__name__})")
        return loss


@dataclass
class _Outputs:
    logits: torch.Tensor


def build_loss(model, chunk_tokens: int | None, device: torch.device, amp=None,
               vocab_size: int | None = None, user_fn=None
               ) -> FullLoss | ChunkedLoss | UserLoss:
    """A language model's next-token loss for `training.loss_chunk_tokens`, checked against the
    full loss on a probe batch (before any wrapping) so a model that transforms its logits is
    refused; `user_fn`: training.compute_loss_func on the model's full outputs. Other model
    kinds bring their own (engine.kinds: a classifier's per-row loss, an encoder-decoder's
    unshifted one)."""
    if user_fn is not None:
        return UserLoss(user_fn)
    if chunk_tokens is None:
        return FullLoss()
    loss = ChunkedLoss(model, chunk_tokens, device)
    vocab = vocab_size or base_model(model).config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX
    inputs = {"input_ids": ids.to(device)}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            full = FullLoss().loss_sum(model(**inputs, use_cache=False), labels.to(device))
            with loss.computing(labels):
                chunked = loss.loss_sum(model(**inputs, use_cache=False), labels)
    finally:
        model.train(was_training)
    if not torch.allclose(full.float(), chunked.float(), rtol=1e-3 if amp else 1e-5):
        raise PipelineError(
            f"training.loss_chunk_tokens: {type(base_model(model)).__name__} changes its "
            f"logits after the output layer (probe loss {float(chunked):.6g} vs "
            f"{float(full):.6g}); set training.loss_chunk_tokens: null")
    return loss


def probe_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch a replacement loss (Liger's, a fused_loss_factory's) is checked on
    against the full cross entropy: 2 random rows of 64 tokens, the first 16 unlabelled."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 64), generator=g)
    labels = ids.clone()
    labels[:, :16] = IGNORE_INDEX
    return ids, labels


def loss_and_grads(model, loss, ids: torch.Tensor, labels: torch.Tensor, device, amp
                   ) -> tuple[float, list[torch.Tensor]]:
    """One forward and backward of a probe batch with `loss` (how Liger and
    fused_loss_factory are checked against FullLoss); the gradients cloned, then cleared."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None), \
            loss.computing(labels):
        output = model(input_ids=ids.to(device), use_cache=False)
    summed = loss.loss_sum(output, labels.to(device))
    summed.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for p in params]
    for p in params:
        p.grad = None
    return float(summed.detach()), grads


def relative_errors(reference: tuple[float, list[torch.Tensor]],
                    probed: tuple[float, list[torch.Tensor]]) -> tuple[float, float]:
    """(loss, gradient) relative errors of a probed loss against the reference's, each a
    `loss_and_grads` result: the gradient error is the norm of the difference over all
    trainable parameters, relative to the reference gradient's norm."""
    (before, before_grads), (after, after_grads) = reference, probed
    num = sum(float((a - b).float().pow(2).sum()) for a, b in zip(after_grads, before_grads))
    den = sum(float(b.float().pow(2).sum()) for b in before_grads)
    return abs(after - before) / max(abs(before), 1e-12), (num / max(den, 1e-30)) ** 0.5
