"""Held-out loss: token-weighted over the whole split (or the first `max_batches`), all ranks;
a classifier's predicted classes; and what the evaluate stage hands a method (`HeldOut`) and
gets back (`Evaluated`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engine.datapath.data import (
    KIND_INPUTS,
    IGNORE_INDEX,
    collate,
    count_targets,
    label_shift,
    take_rows,
    token_loss_sum,
)
from engine.modeling.adapter import adapter_disabled, has_adapter
from engine.process.distributed import Dist, all_reduce_sum


@torch.no_grad()
def evaluate_loss(model, dataset, batch_size: int, pad_id: int, dist: Dist | None = None,
                  max_batches: int | None = None, autocast_dtype: torch.dtype | None = None,
                  lockstep: bool = False, loss_sum_fn=None,
                  collate_fn: Callable[[list[dict]], dict] | None = None,
                  on_batch: Callable[[], None] | None = None, per_row: bool = False) -> dict:
    """Mean next-token loss and perplexity; rank r takes batches r, r+world, ...

    `collate_fn`: builds each batch from its rows (a model kind's eval_collate, engine.kinds: the
    project's data.collate_fn when set); None: dynamic padding with `pad_id`.
    `lockstep`: every rank runs the same number of forwards (FSDP2 all-gathers inside forward,
    so a rank with one batch fewer would hang the others); the extra ones are not counted.
    `loss_sum_fn(logits, labels)`: the summed loss (a classifier's is per row); None: the
    token loss, shifted as the batch's layout says (engine.datapath.data.label_shift).
    `on_batch()`: called after each batch (a progress bar).
    `per_row`: also each example's loss sum and target-token count (`row_loss_sums`,
    `row_tokens`: float64 and int64 tensors on the CPU, this rank's rows in order), for a
    bootstrap stderr (engine.evaluation.bootstrap). Only meaningful where a batch row is one
    example (the pipeline's padding collators; a collator that packs several examples into a
    row gives per-packed-row sums, which are not the examples the stderr is about: the caller
    asks for none then)."""
    if per_row and loss_sum_fn is not None:
        raise ValueError("evaluate_loss: per_row measures the token loss; a loss_sum_fn's "
                         "rows are the caller's to split")
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)
    device = dist.device if dist else torch.device("cpu")
    was_training = model.training
    model.eval()
    starts = list(range(0, len(dataset), batch_size))
    if max_batches:
        starts = starts[:max_batches]
    loss_sum, tokens, rows_out = 0.0, 0, []
    mine = starts[rank::world]
    rounds = -(-len(starts) // world) if lockstep else len(mine)
    for i in range(rounds):
        counted = i < len(mine)
        start = mine[i] if counted else starts[0]
        rows = take_rows(dataset, range(start, min(start + batch_size, len(dataset))))
        batch = collate_fn(rows) if collate_fn else collate(rows, pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch.get("attention_mask"),
                           **{k: batch[k] for k in KIND_INPUTS if k in batch}).logits
        if counted:
            tokens += count_targets(batch)
            loss_sum += float(loss_sum_fn(logits, batch["labels"]) if loss_sum_fn
                              else token_loss_sum(logits, batch["labels"], label_shift(batch)))
            if per_row:
                rows_out.append(row_loss_sums(logits, batch["labels"], label_shift(batch)))
        if on_batch is not None:
            on_batch()
    if dist:
        loss_sum, tokens = all_reduce_sum(loss_sum, dist), int(all_reduce_sum(tokens, dist))
    model.train(was_training)
    loss = loss_sum / max(tokens, 1)
    out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}
    if per_row:  # one host copy at the end, not one per batch
        sums = torch.cat(rows_out, dim=1).cpu() if rows_out else torch.zeros(2, 0,
                                                                            dtype=torch.float64)
        out.update(row_loss_sums=sums[0], row_tokens=sums[1].long())
    return out


def row_loss_sums(logits: torch.Tensor, labels: torch.Tensor, shift: int = 1) -> torch.Tensor:
    """[2, rows]: each row's summed next-token cross entropy (`token_loss_sum` per row, in
    float64) and its target-token count, for the whole batch in one call."""
    shift_logits = logits[:, :logits.shape[1] - shift, :].float()
    shift_labels = labels[:, shift:]
    per_token = torch.nn.functional.cross_entropy(
        shift_logits.transpose(1, 2), shift_labels, ignore_index=IGNORE_INDEX,
        reduction="none")
    counted = shift_labels != IGNORE_INDEX
    return torch.stack([per_token.double().sum(1), counted.sum(1).double()])


@torch.no_grad()
def scored_batches(model, dataset, batch_size: int, collate_rows: Callable[[list[dict]], dict],
                   score: Callable[[torch.Tensor, dict, list[dict]], Any]) -> list:
    """`score(logits, batch, rows)` for each batch of `dataset` in order, the model in eval
    mode on its own device (its mode restored after): the loop every method's held-out numbers
    share (a classifier's classes, preference pairs, labelled completions, reward pairs)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    try:
        for start in range(0, len(dataset), batch_size):
            rows = take_rows(dataset, range(start, min(start + batch_size, len(dataset))))
            batch = collate_rows(rows)
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device),
                           **{k: batch[k].to(device) for k in KIND_INPUTS if k in batch}).logits
            out.append(score(logits, batch, rows))
    finally:
        model.train(was_training)
    return out


def predict_classes(model, dataset, batch_size: int, pad_id: int) -> tuple[list[int], list[int]]:
    """A sequence classifier's (predicted, true) class ids over a tokenized split."""
    batches = scored_batches(
        model, dataset, batch_size, lambda rows: collate(rows, pad_id),
        lambda logits, batch, _: (logits.argmax(dim=-1).tolist(),
                                  batch["labels"].max(dim=1).values.tolist()))
    return ([c for p, _ in batches for c in p], [c for _, t in batches for c in t])


@dataclass
class HeldOut:
    """What the evaluate stage hands a method's `heldout_metrics` (engine.evaluate builds it):
    the config, the held-out split (the columns the method reads), both models, and the
    stage's own parts that a method may use: the generation prompts and the dataset types'
    scoring. The fine-tuned model is loaded on first use: loading injects the adapter into
    the base in place, so a method measures the base first, then asks for `tuned()`, and
    after that reaches the base through `as_base()`."""

    cfg: Any
    root: Path
    trained: Path
    test: Any  # the tokenized test split (datasets.Dataset)
    tokenizer: Any
    labels: list[str] | None  # a classifier's class names (from the trained folder)
    base: torch.nn.Module
    load_tuned: Callable[[torch.nn.Module], torch.nn.Module]  # base -> the fine-tuned model
    #: the generation prompts and references (a DataFrame with prompt, reference, part), or
    #: None when eval asks for no generation metric
    rows: Callable[[], Any]
    #: the types' metrics: .generations(rows, texts) -> (scores, per-row values of the means
    #: over rows, for their bootstrap stderr), .classes(predicted, true) -> scores
    scorer: Any
    _tuned: torch.nn.Module | None = field(default=None, repr=False)

    def tuned(self) -> torch.nn.Module:
        if self._tuned is None:
            self._tuned = self.load_tuned(self.base)
        return self._tuned

    @contextlib.contextmanager
    def as_base(self):
        """The base model, also once the fine-tuned one is loaded (then: the fine-tuned model
        with its adapter disabled)."""
        if self._tuned is None or not has_adapter(self._tuned):
            yield self.base
            return
        with adapter_disabled(self._tuned):
            yield self._tuned


@dataclass
class Evaluated:
    """A method's held-out numbers: per model (base, finetuned, quantized) its metrics, the
    split-level counts next to them in the metrics file, and the samples table."""

    results: dict[str, dict]
    counts: dict[str, int]
    samples: list[dict]
