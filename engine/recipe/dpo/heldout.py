"""How a model ranks held-out preference pairs: the evaluate stage's numbers for a DPO run
(beside the SFT run's loss and generations, engine.recipe.sft), each with its bootstrap stderr
over the pairs."""

from __future__ import annotations

import torch

from engine.datapath.data import collate
from engine.evaluation.bootstrap import bootstrap_seed, stderrs
from engine.evaluation.heldout import scored_batches
from engine.kinds import kind_of
from engine.objective.logprobs import sequence_logps
from engine.recipe.dpo.batches import collate_pairs


def pair_log_probs(model, dataset, batch_size: int, pad_id: int,
                   sides_collate=None) -> torch.Tensor:
    """[pairs, 4]: each held-out pair's summed log-probability of its chosen and rejected
    completion and their trained-token counts (chosen, rejected, n chosen, n rejected), the two
    sides of a batch scored in one forward as the DPO run does (on the CPU, float64).
    `sides_collate`: how the 2b sides are batched, the model kind's evaluation batches (a
    vision-language model's carry the pairs' images); default: dynamic padding."""
    def score(logits, batch, _rows):
        logps, counts = sequence_logps(logits, batch["labels"].to(logits.device))
        return torch.stack([*logps.chunk(2), *counts.chunk(2)], dim=1).double().cpu()

    sides_collate = sides_collate or (lambda sides: collate(sides, pad_id))
    out = scored_batches(model, dataset, batch_size,
                         lambda rows: collate_pairs(rows, sides_collate), score)
    return torch.cat(out) if out else torch.zeros(0, 4, dtype=torch.float64)


def ranking_scores(scored: torch.Tensor, reference: torch.Tensor, dpo) -> dict[str, float]:
    """How a model ranks held-out pairs, from `pair_log_probs` rows (chosen, rejected, their
    token counts) of the model and of the `reference` (the base model; for the base itself,
    the same rows). Ties count half.
    - preference_accuracy: the share of pairs whose chosen side gets the higher implicit
      reward, the one `dpo.loss_type` trains: beta x (log pi - log pi_ref), or for simpo and orpo
      beta x the length-averaged log pi. The base is its own reference: every pair ties, 0.5.
    - reward_margin: the mean implicit reward margin (chosen - rejected).
    - likelihood_accuracy, logp_margin: the same from the model's own summed log-probabilities,
      no reference (how likely it finds each side)."""
    return {k: float(v.mean()) for k, v in ranking_rows(scored, reference, dpo).items()}


def ranking_rows(scored: torch.Tensor, reference: torch.Tensor, dpo) -> dict[str, torch.Tensor]:
    """`ranking_scores`' per-pair values (1, 0.5 on a tie, 0 for the accuracies; the margins),
    whose means are the scores and whose bootstrap gives their stderrs."""
    if len(scored) == 0:
        return {}
    chosen, rejected, n_chosen, n_rejected = scored.unbind(1)
    own = chosen - rejected
    if not dpo.uses_reference:  # simpo, orpo
        reward = dpo.beta * (chosen / n_chosen.clamp_min(1) - rejected / n_rejected.clamp_min(1))
    else:
        reward = dpo.beta * (own - (reference[:, 0] - reference[:, 1]))

    def ranked(margin: torch.Tensor) -> torch.Tensor:
        return (margin > 0).double() + 0.5 * (margin == 0).double()

    return {"preference_accuracy": ranked(reward), "reward_margin": reward,
            "likelihood_accuracy": ranked(own), "logp_margin": own}


def rank_pairs(held, results: dict) -> None:
    """Preference pairs: how the base and the fine-tuned model rank each held-out pair's
    chosen side over its rejected one, by the implicit reward against the base and by their
    own likelihood (`ranking_scores`), into each model's results."""
    pad = held.tokenizer.pad_token_id
    kind = kind_of(held.cfg)
    with held.as_base() as model:
        base = pair_log_probs(model, held.test, held.cfg.training.per_device_eval_batch_size,
                              pad, kind.eval_collate(held.cfg, model, pad))
    tuned_model = held.tuned()
    tuned = pair_log_probs(tuned_model, held.test, held.cfg.training.per_device_eval_batch_size,
                           pad, kind.eval_collate(held.cfg, tuned_model, pad))
    cfg = held.cfg
    for name, scored in (("base", base), ("finetuned", tuned)):
        rows = ranking_rows(scored, base, cfg.dpo)
        results[name].update({k: round(float(v.mean()), 6) for k, v in rows.items()})
        results[name].update(stderrs(rows, cfg.eval.bootstrap_samples, bootstrap_seed(cfg)))
