"""Where a model's implicit reward puts held-out labelled completions: the evaluate stage's
numbers for a KTO run (beside the SFT run's loss and generations, engine.recipe.sft)."""

from __future__ import annotations

import torch

from engine.datapath.data import collate
from engine.evaluation.bootstrap import bootstrap_seed, ratio_stderr
from engine.evaluation.heldout import scored_batches
from engine.objective.logprobs import sequence_logps
from finetune.datatypes.unpaired_preference import LABEL_COLUMN


def row_log_probs(model, dataset, batch_size: int, pad_id: int) -> torch.Tensor:
    """[rows, 2]: each held-out row's summed log-probability of its completion and its label
    (1 desirable, 0 not), on the CPU in float64."""
    def score(logits, batch, rows):
        logps = sequence_logps(logits, batch["labels"].to(logits.device))[0].double().cpu()
        labels = torch.tensor([float(r[LABEL_COLUMN]) for r in rows], dtype=torch.float64)
        return torch.stack([logps, labels], dim=1)

    out = scored_batches(model, dataset, batch_size, lambda rows: collate(rows, pad_id), score)
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.float64)


def unpaired_scores(scored: torch.Tensor, reference: torch.Tensor, beta: float
                    ) -> dict[str, float]:
    """From `row_log_probs` rows of a model and of the `reference` (the base; for the base
    itself, the same rows), with the implicit reward beta x (log pi - log pi_ref). Ties (a
    reward of exactly 0) count half; the base is its own reference: 0.5 everywhere.
    - kto_accuracy: the share of rows whose reward has its label's sign (desirable above 0,
      undesirable below);
    - desirable_accuracy, undesirable_accuracy: the same within each label;
    - reward_margin: the mean reward of the desirable rows minus the undesirable rows'."""
    if len(scored) == 0:
        return {}
    reward = beta * (scored[:, 0] - reference[:, 0])
    desirable = scored[:, 1] > 0.5
    signed = torch.where(desirable, reward, -reward)
    right = (signed > 0).double() + 0.5 * (signed == 0).double()
    out = {"kto_accuracy": float(right.mean())}
    for name, rows in (("desirable", desirable), ("undesirable", ~desirable)):
        if rows.any():
            out[f"{name}_accuracy"] = float(right[rows].mean())
    if desirable.any() and (~desirable).any():
        out["reward_margin"] = float(reward[desirable].mean() - reward[~desirable].mean())
    return out


def rank_rows(held, results: dict) -> None:
    """Labelled completions: where the base's and the fine-tuned model's implicit reward (the
    base as the reference) puts each held-out completion, into each model's results."""
    args = (held.test, held.cfg.training.per_device_eval_batch_size,
            held.tokenizer.pad_token_id)
    with held.as_base() as model:
        base = row_log_probs(model, *args)
    tuned = row_log_probs(held.tuned(), *args)
    cfg = held.cfg
    for name, scored in (("base", base), ("finetuned", tuned)):
        results[name].update(
            {k: round(v, 6) for k, v in unpaired_scores(scored, base, cfg.kto.beta).items()})
        results[name].update(accuracy_stderrs(scored, base, cfg.kto.beta,
                                              cfg.eval.bootstrap_samples, bootstrap_seed(cfg)))


def accuracy_stderrs(scored: torch.Tensor, reference: torch.Tensor, beta: float, samples: int,
                     seed: int) -> dict[str, float]:
    """The bootstrap stderrs of `unpaired_scores`' accuracies over the rows: kto_accuracy a
    mean over rows, each label's accuracy a ratio (its right rows over its rows). The
    reward_margin, a difference of two labels' means, gets none."""
    if len(scored) == 0:
        return {}
    right, desirable = _right(scored, reference, beta)
    out = {}
    for name, weight in (("kto", torch.ones_like(right)), ("desirable", desirable.double()),
                         ("undesirable", (~desirable).double())):
        if weight.any():
            se = ratio_stderr(right * weight, weight, samples, seed)
            if se is not None:
                out[f"{name}_accuracy_stderr"] = round(se, 6)
    return out


def _right(scored: torch.Tensor, reference: torch.Tensor, beta: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row: 1 where its reward has its label's sign, 0.5 on a tie, else 0; and whether
    it is desirable."""
    reward = beta * (scored[:, 0] - reference[:, 0])
    desirable = scored[:, 1] > 0.5
    signed = torch.where(desirable, reward, -reward)
    return (signed > 0).double() + 0.5 * (signed == 0).double(), desirable
