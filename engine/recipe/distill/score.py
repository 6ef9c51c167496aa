"""The offline teacher: its top-k next-token ids and log-probabilities at every trained token of
a tokenized split, a few rows at a time (the teacher stage, tasks/teacher.py, writes them), and
the run's side: those columns read back for a micro-batch's rows, in the loss's target-row
order.

Memory stays bounded: `batch_rows` rows are forwarded at a time, the teacher's output layer is
applied to the target rows only, `chunk_tokens` at a time (never a batch's full-vocabulary
logits), and each batch's columns are handed on before the next is scored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from engine.datapath.data import collate, load_tokenized, take_rows
from engine.objective.loss import target_rows
from engine.recipe.distill.loss import log_probs
from engine.recipe.distill.teacher import TeacherRows, load_teacher

#: the teacher stage's columns: per row, its trained tokens' top-k, flattened (tokens x k)
IDS, LOGPS = "teacher_ids", "teacher_logps"


def features():
    """The columns' datasets features: ids int32, log-probabilities float32."""
    import datasets

    return datasets.Features({IDS: datasets.Sequence(datasets.Value("int32")),
                              LOGPS: datasets.Sequence(datasets.Value("float32"))})


def score_split(teacher_dir: Path, split: Path, top_k: int, temperature: float,
                pad_id: int, batch_rows: int = 8, chunk_tokens: int = 1024,
                device: torch.device | None = None) -> Iterator[dict[str, list]]:
    """{IDS: [...], LOGPS: [...]} for each `batch_rows` rows of the tokenized `split`, in
    order: each row's trained tokens (labels[1:] != -100, left to right) x its `top_k`
    ids (int) and log-probabilities of logits / temperature (float32)."""
    device = device or torch.device("cpu")
    model = load_teacher(teacher_dir, device)
    vocab = model.get_output_embeddings().weight.shape[0]
    k = min(top_k, vocab)
    scorer = TeacherRows(model)
    ds = load_tokenized(split, ("input_ids", "labels"))
    for start in range(0, len(ds), batch_rows):
        batch = collate(take_rows(ds, range(start, min(start + batch_rows, len(ds)))), pad_id)
        labels = batch["labels"]
        inputs = {"input_ids": batch["input_ids"].to(device),
                  "attention_mask": batch["attention_mask"].to(device)}
        hidden = scorer.hidden_at(inputs, labels)
        ids, logps = [], []
        with torch.no_grad():
            for s in range(0, len(hidden), chunk_tokens):
                lp = log_probs(scorer.head(hidden[s:s + chunk_tokens]), temperature)
                top = lp.topk(k, dim=-1)
                ids.append(top.indices.to(torch.int32).cpu())
                logps.append(top.values.cpu())
        flat_ids = torch.cat(ids) if ids else torch.zeros(0, k, dtype=torch.int32)
        flat_lps = torch.cat(logps) if logps else torch.zeros(0, k)
        # each row's share of the target rows (target_rows orders them row by row)
        counts = (labels[:, 1:] != -100).sum(dim=1).tolist()
        out = {IDS: [], LOGPS: []}
        for part_ids, part_lps in zip(flat_ids.split(counts), flat_lps.split(counts)):
            out[IDS].append(part_ids.reshape(-1).tolist())
            out[LOGPS].append(part_lps.reshape(-1).tolist())
        yield out


class TeacherColumns:
    """The teacher stage's columns (a saved split, row i for the tokenized split's row i),
    read for a micro-batch's rows as the loss's Teacher: [target rows, k] ids and log-probs."""

    def __init__(self, path: Path, top_k: int):
        import datasets

        self.ds = datasets.load_from_disk(str(path))
        self.k = top_k

    def __len__(self) -> int:
        return len(self.ds)

    def batch(self, rows: list[int], host_labels: torch.Tensor, device: torch.device):
        """(ids [n, k] long, log-probs [n, k]) of the rows' trained tokens, on `device`; one
        line when the stage's columns do not cover these labels (a stale teacher split)."""
        from finetune.errors import PipelineError

        import pyarrow.compute as pc

        table = self.ds.with_format("arrow")[list(rows)]  # one Arrow take, flattened whole
        ids = torch.from_numpy(pc.list_flatten(table[IDS]).to_numpy(
            zero_copy_only=False).astype("int64"))
        lps = torch.from_numpy(pc.list_flatten(table[LOGPS]).to_numpy(
            zero_copy_only=False).astype("float32"))
        n = len(target_rows(host_labels)[0])
        if ids.numel() != n * self.k:
            raise PipelineError(
                f"distill: the teacher stage's columns hold {ids.numel() // max(self.k, 1)} "
                f"trained tokens for split rows {rows[:4]}..., the batch {n}: rerun the "
                "teacher stage (dvc repro teacher)")
        return (ids.reshape(n, self.k).to(device, non_blocking=True),
                lps.reshape(n, self.k).to(device, non_blocking=True))
