"""Standard errors of our own held-out metrics, by bootstrap over the held-out rows.

Why: the promotion gate judges a metric in standard-error units (registry.guard_metrics'
max_drop_stderr, registry.min_improvement_stderr) only when the metric has a stderr. lm-eval
reports its own; a metric the evaluate stage measures itself (loss, perplexity, exact match,
accuracy, pair ranking) is a mean over rows, or a ratio of two sums over rows (the
token-weighted loss: sum of the rows' loss sums / sum of their target tokens), so resampling
the rows with replacement says how much it would move on another draw of the same size.

All resamples at once: one [B, n] index tensor from a seeded torch.Generator on the values'
device, then gathers and sums (no Python loop over rows or resamples; the resamples go in
chunks only to bound the index tensor's memory on a large split). The seed is the run's
training seed, so the same evaluation gives the same stderr.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

#: index elements per chunk of resamples (int64: 128 MiB), so a large split cannot ask for
#: gigabytes of indices at once
CHUNK_ELEMENTS = 1 << 24


def ratio_stderr(numerators, denominators, samples: int, seed: int,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> float | None:
    """The bootstrap standard error of sum(numerators) / sum(denominators) (optionally
    `transform`ed per resample, e.g. torch.exp for a perplexity from a loss): the std of the
    statistic over `samples` resamples of the n rows with replacement. None when `samples` is
    0 (eval.bootstrap_samples 0: no stderrs) or there are fewer than two rows (no spread to
    measure); a resample whose denominators sum to 0 counts as 0."""
    num = torch.as_tensor(numerators, dtype=torch.float64)
    den = torch.as_tensor(denominators, dtype=torch.float64, device=num.device)
    n = num.numel()
    if samples <= 0 or n < 2:
        return None
    generator = torch.Generator(device=num.device).manual_seed(seed)
    step = max(1, CHUNK_ELEMENTS // n)
    stats = []
    for start in range(0, samples, step):
        index = torch.randint(n, (min(step, samples - start), n), generator=generator,
                              device=num.device)
        stats.append(num[index].sum(1) / den[index].sum(1).clamp_min(1e-300))
    values = torch.cat(stats)
    if transform is not None:
        values = transform(values)
    return float(values.std()) if samples > 1 else 0.0


def mean_stderr(values, samples: int, seed: int,
                transform: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> float | None:
    """The bootstrap standard error of the mean of per-row `values` (`ratio_stderr` with a
    denominator of 1 per row)."""
    values = torch.as_tensor(values, dtype=torch.float64)
    return ratio_stderr(values, torch.ones_like(values), samples, seed, transform)


def bootstrap_seed(cfg) -> int:
    """The resamples' seed: training.seed, or for an unseeded run the seed the evaluate stage
    seeded torch with (the one its training drew)."""
    seed = cfg.training.seed
    return torch.initial_seed() if seed is None else seed


def perplexity(loss: torch.Tensor) -> torch.Tensor:
    """exp(loss), capped as the reported perplexity is (math.exp(min(loss, 50)))."""
    return torch.exp(loss.clamp(max=50.0))


def stderrs(per_row: dict[str, object], samples: int, seed: int, digits: int = 6
            ) -> dict[str, float]:
    """`<metric>_stderr` of each metric's per-row values (a mean over rows), rounded as the
    metrics are; metrics with no stderr (too few rows, samples 0) left out."""
    out = {}
    for name, values in per_row.items():
        se = mean_stderr(values, samples, seed)
        if se is not None and math.isfinite(se):
            out[f"{name}_stderr"] = round(se, digits)
    return out
