"""The evaluate stage's numbers for a distillation run, beside the SFT run's (the student's
held-out loss and perplexity, base and fine-tuned): the teacher's held-out loss on the same
trained tokens (`teacher_loss`), and how often the student's most likely next token is the
teacher's (`teacher_agreement`, the top-1 match rate over the trained tokens), for the base
and the fine-tuned student.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.datapath.data import IGNORE_INDEX, collate
from engine.evaluation.heldout import scored_batches


def top1(model, dataset, batch_size: int, pad_id: int) -> tuple[torch.Tensor, float, int]:
    """(argmax ids of every trained token, in split order; summed cross entropy; tokens)."""
    def score(logits, batch, rows):
        labels = batch["labels"][:, 1:].to(logits.device)
        keep = labels != IGNORE_INDEX
        shifted = logits[:, :-1][keep].float()
        ce = torch.nn.functional.cross_entropy(shifted, labels[keep], reduction="sum")
        return shifted.argmax(-1).cpu(), float(ce), int(keep.sum())

    with torch.no_grad():
        out = scored_batches(model, dataset, batch_size, lambda rows: collate(rows, pad_id),
                             score)
    ids = torch.cat([o[0] for o in out]) if out else torch.zeros(0, dtype=torch.long)
    return ids, sum(o[1] for o in out), sum(o[2] for o in out)


def teacher_numbers(held, results: dict) -> None:
    """The teacher's loss and each student's top-1 agreement with it, into `results`."""
    from engine.recipe.distill.teacher import load_teacher

    cfg = held.cfg
    args = (held.test, cfg.training.per_device_eval_batch_size, held.tokenizer.pad_token_id)
    device = next(held.base.parameters()).device
    teacher = load_teacher(Path(held.root) / cfg.distill.teacher, device)
    teacher_ids, ce, n = top1(teacher, *args)
    del teacher
    if n == 0:
        return
    with held.as_base() as model:
        base_ids, _, _ = top1(model, *args)
    tuned_ids, _, _ = top1(held.tuned(), *args)
    for name, ids in (("base", base_ids), ("finetuned", tuned_ids)):
        results[name]["teacher_loss"] = round(ce / n, 6)
        results[name]["teacher_agreement"] = round(float((ids == teacher_ids).double().mean()),
                                                   6)
