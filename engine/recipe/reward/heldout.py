"""A reward model's held-out numbers for the evaluate stage: how often the base (its head
untrained: chance) and the trained reward model score each held-out pair's chosen side above
its rejected one, the mean reward margin, and the Bradley-Terry loss, each with its bootstrap
stderr over the pairs; the samples table shows a few pairs with both models' rewards."""

from __future__ import annotations

import torch

from engine.datapath.data import collate
from engine.evaluation.bootstrap import bootstrap_seed, stderrs
from engine.evaluation.heldout import Evaluated, scored_batches
from engine.recipe.reward.batches import collate_rewarded
from engine.recipe.reward.loss import bradley_terry


def pair_rewards(model, dataset, batch_size: int, pad_id: int) -> torch.Tensor:
    """[pairs, 3]: each held-out pair's reward of its chosen and its rejected side, and its
    margin (0 without a margin column), both sides of a batch in one forward (on the CPU)."""
    def score(rewards, batch, rows):
        chosen, rejected = rewards.reshape(-1).float().cpu().chunk(2)
        margin = batch.get("margin", torch.zeros(len(rows)))
        return torch.stack([chosen, rejected, margin.float()], dim=1)

    out = scored_batches(
        model, dataset, batch_size,
        lambda rows: collate_rewarded(rows, lambda sides: collate(sides, pad_id)), score)
    return torch.cat(out) if out else torch.zeros(0, 3)


def ranking(scored: torch.Tensor, center_coefficient: float | None) -> dict[str, float]:
    """From `pair_rewards` rows: preference_accuracy (the share of pairs with r_chosen >
    r_rejected, TRL's accuracy), reward_margin (the mean r_chosen - r_rejected) and the mean
    Bradley-Terry loss."""
    return {k: float(v.mean()) for k, v in ranking_rows(scored, center_coefficient).items()}


def ranking_rows(scored: torch.Tensor, center_coefficient: float | None
                 ) -> dict[str, torch.Tensor]:
    """`ranking`'s per-pair values, whose means are its numbers and whose bootstrap gives
    their stderrs."""
    if len(scored) == 0:
        return {}
    chosen, rejected, margin = scored.unbind(1)
    pairs = bradley_terry(torch.cat([chosen, rejected]), margin, center_coefficient)
    return {"loss": pairs.losses, "preference_accuracy": (chosen > rejected).float(),
            "reward_margin": chosen - rejected}


def reward_metrics(held) -> Evaluated:
    cfg, tok = held.cfg, held.tokenizer
    args = (held.test, cfg.training.per_device_eval_batch_size, tok.pad_token_id)
    base = pair_rewards(held.base, *args)
    tuned = pair_rewards(held.tuned(), *args)
    coefficient = cfg.reward.center_rewards_coefficient
    results = {}
    for name, scored in (("base", base), ("finetuned", tuned)):
        rows = ranking_rows(scored, coefficient)
        results[name] = {k: round(float(v.mean()), 6) for k, v in rows.items()}
        results[name].update(stderrs(rows, cfg.eval.bootstrap_samples, bootstrap_seed(cfg)))
    samples = []
    for i in range(min(cfg.eval.num_logged_samples, len(held.test))):
        row = held.test[i]
        samples.append({
            "chosen": tok.decode(row["input_ids"], skip_special_tokens=True),
            "rejected": tok.decode(row["rejected_input_ids"], skip_special_tokens=True),
            "reward_chosen": round(float(tuned[i, 0]), 6),
            "reward_rejected": round(float(tuned[i, 1]), 6),
            "base_reward_chosen": round(float(base[i, 0]), 6),
            "base_reward_rejected": round(float(base[i, 1]), 6)})
    return Evaluated(results, {"eval_rows": len(held.test)}, samples)
