"""Held-out loss: token-weighted over the whole split (or the first `max_batches`), all ranks;
and how a model scores the two sides of held-out preference pairs."""

from __future__ import annotations

import math

import torch

from engine.datapath.data import (
    collate,
    collate_pairs,
    count_targets,
    take_rows,
    token_loss_sum,
)
from engine.objective.preference import sequence_logps
from engine.process.distributed import Dist, all_reduce_sum


@torch.no_grad()
def evaluate_loss(model, dataset, batch_size: int, pad_id: int, dist: Dist | None = None,
                  max_batches: int | None = None, autocast_dtype: torch.dtype | None = None,
                  lockstep: bool = False, loss_sum_fn=token_loss_sum) -> dict:
    """Mean next-token loss and perplexity; rank r takes batches r, r+world, ...

    `lockstep`: every rank runs the same number of forwards (FSDP2 all-gathers inside forward,
    so a rank with one batch fewer would hang the others); the extra ones are not counted.
    `loss_sum_fn(logits, labels)`: the summed loss (a classifier's is per row)."""
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)
    device = dist.device if dist else torch.device("cpu")
    was_training = model.training
    model.eval()
    starts = list(range(0, len(dataset), batch_size))
    if max_batches:
        starts = starts[:max_batches]
    loss_sum, tokens = 0.0, 0
    mine = starts[rank::world]
    rounds = -(-len(starts) // world) if lockstep else len(mine)
    for i in range(rounds):
        counted = i < len(mine)
        start = mine[i] if counted else starts[0]
        batch = collate(take_rows(dataset, range(start, min(start + batch_size, len(dataset)))),
                        pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if counted:
            tokens += count_targets(batch)
            loss_sum += float(loss_sum_fn(logits, batch["labels"]))
    if dist:
        loss_sum, tokens = all_reduce_sum(loss_sum, dist), int(all_reduce_sum(tokens, dist))
    model.train(was_training)
    loss = loss_sum / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


@torch.no_grad()
def predict_classes(model, dataset, batch_size: int, pad_id: int) -> tuple[list[int], list[int]]:
    """A sequence classifier's (predicted, true) class ids over a tokenized split."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    predicted, true = [], []
    for start in range(0, len(dataset), batch_size):
        batch = collate(take_rows(dataset, range(start, min(start + batch_size, len(dataset)))),
                        pad_id)
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        predicted += logits.argmax(dim=-1).tolist()
        true += batch["labels"].max(dim=1).values.tolist()
    model.train(was_training)
    return predicted, true


@torch.no_grad()
def pair_log_probs(model, dataset, batch_size: int, pad_id: int) -> torch.Tensor:
    """[pairs, 4]: each held-out pair's summed log-probability of its chosen and rejected
    completion and their trained-token counts (chosen, rejected, n chosen, n rejected), the two
    sides of a batch scored in one forward as the DPO run does (on the CPU, float64)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(dataset), batch_size):
        rows = take_rows(dataset, range(start, min(start + batch_size, len(dataset))))
        batch = collate_pairs(rows, lambda sides: collate(sides, pad_id))
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        logps, counts = sequence_logps(logits, batch["labels"].to(device))
        out.append(torch.stack([*logps.chunk(2), *counts.chunk(2)], dim=1).double().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 4, dtype=torch.float64)
