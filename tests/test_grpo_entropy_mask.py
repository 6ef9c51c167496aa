"""grpo.top_entropy_quantile under data parallelism: the quantile over every rank's tokens
(a light module: the spawned processes import it)."""

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
