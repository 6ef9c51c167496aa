"""GRPO's token statistics under data parallelism: top_entropy_quantile's quantile over every
rank's tokens, and the logged means pooled over every rank's tokens (a light module: the
spawned processes import it)."""

from __future__ import annotations

import torch

from engine.recipe.grpo.loss import high_entropy_mask


def _entropy_mask_on_rank(rank: int, store: str, entropy, mask, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        half = slice(rank * 3, rank * 3 + 3)
        torch.save(high_entropy_mask(entropy[half], mask[half], 0.6), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_top_entropy_quantile_is_over_every_ranks_tokens(tmp_path):
    """Two gloo processes, each with half of the rows (of different lengths, so the ranks
    gather unequal token counts), mark the same tokens as one process with all rows: the
    quantile is taken over every rank's completion tokens, as TRL gathers them."""
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(6, 5, generator=g) * 3
    mask = (torch.arange(5) < torch.tensor([5, 2, 4, 1, 5, 3]).unsqueeze(1)).long()
    whole = high_entropy_mask(entropy, mask, 0.6)
    out = str(tmp_path / "mask")
    mp.spawn(_entropy_mask_on_rank, args=(str(tmp_path / "store"), entropy, mask, out),
             nprocs=2)
    halves = torch.cat([torch.load(f"{out}.{r}") for r in range(2)])
    assert torch.equal(halves, whole) and 0 < int(whole.sum()) < int(mask.sum())
    # each rank alone would take its own quantile: a different mask (the gather matters)
    alone = torch.cat([high_entropy_mask(entropy[s], mask[s], 0.6)
                       for s in (slice(0, 3), slice(3, 6))])
    assert not torch.equal(alone, whole)


def test_the_logged_token_statistics_pool_every_ranks_tokens():
    """Two ranks' window sums (summed by the loop's all-reduce) give the statistics one
    process gets on both halves: token means over all tokens, a grpo run included (whose
    targets are completions, so weighting each rank's mean by its targets would not be the
    mean over the tokens when the ranks hold different token counts)."""
    from engine.recipe.grpo.loss import (TOKEN_SLOTS, Objective, stat_means, token_losses,
                                         token_stat_sums)
    from engine.recipe.grpo.run import ROLLOUT_TARGETS, GRPORun

    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(6, 5, generator=g) * 3
    old = logps - 0.3 * torch.rand(6, 5, generator=g)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    entropy = torch.rand(6, 5, generator=g)
    mask = (torch.arange(5) < torch.tensor([5, 5, 4, 1, 1, 2]).unsqueeze(1)).long()
    objective = Objective("grpo", 0.2, 0.2, 0.0)

    def sums(rows):
        losses = token_losses(logps[rows], old[rows], None, advantages[rows], mask[rows],
                              objective)
        return token_stat_sums(losses, entropy[rows], mask[rows])

    halves = sums(slice(0, 3)) + sums(slice(3, 6))  # the ranks' sums, all-reduced
    run = GRPORun.__new__(GRPORun)
    run.objective, run.step_names = objective, ("reward",)
    logged = run.window_means({**dict(zip(TOKEN_SLOTS, halves.tolist())), "reward": 6.0,
                               ROLLOUT_TARGETS: 6.0}, targets=6.0)
    whole = stat_means(sums(slice(0, 6)), objective)
    assert logged.keys() == {*whole, "reward"} and logged["reward"] == 1.0
    for name, value in whole.items():
        assert abs(logged[name] - float(value)) < 1e-6, name  # float32 sums
    # the old weighting (each rank's token mean times its 3 completions) is another number
    weighted = sum(float(stat_means(sums(r), objective)["entropy"]) * 3
                   for r in (slice(0, 3), slice(3, 6))) / 6
    assert abs(weighted - float(whole["entropy"])) > 1e-3
