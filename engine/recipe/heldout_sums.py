"""In-training evaluation for the methods whose held-out numbers are sums over rows (dpo,
reward, kto): one loop over the eval split, the method supplying only what a batch adds.

Why a seam: each such method scores a held-out batch its own way (a pair's DPO loss, a
Bradley-Terry loss, a KTO loss with the batch's KL estimate), but the rest is the same and must
stay the same for every one of them: the model in eval mode and back, the split cut into
lockstep batches so every rank runs the same number of forwards (FSDP2's collectives need it),
`eval.eval_batches` honoured, the padding rows of an uneven last share not counted, the sums
all-reduced once, and the result published to the monitor and the reporters like the SFT run's
evaluation. A new offline method implements `eval_batch_sums` and calls `held_out_evaluation`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from engine.datapath.data import take_rows, to_device
from engine.recipe.reference import lockstep_batches


class HeldOutSums:
    """A mixin for TrainingRun subclasses (see the module docstring). The class that mixes it
    in defines `eval_batch_sums(batch, real) -> torch.Tensor`: [loss sum, rows counted,
    *statistic sums] of one held-out batch (float64), its first `real` rows counted (the rest
    pad an uneven last share); a class without it is refused when it is defined."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not callable(getattr(cls, "eval_batch_sums", None)):
            raise TypeError(f"{cls.__name__} mixes in HeldOutSums but defines no "
                            "eval_batch_sums(batch, real)")

    @contextlib.contextmanager
    def _eval_mode(self):
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    @torch.no_grad()
    def held_out_sums(self, dataset, width: int) -> torch.Tensor:
        """`eval_batch_sums` summed over this split (the first eval.eval_batches batches per
        rank when set) and over ranks: a [width] float64 tensor."""
        size = self.cfg.training.per_device_eval_batch_size
        limit = self.cfg.eval.eval_batches
        sums = torch.zeros(width, dtype=torch.float64, device=self.dist.device)
        batches = lockstep_batches(len(dataset), size, self.dist.rank, self.dist.world_size)
        for k, (indices, real) in enumerate(batches):
            if limit is not None and k >= limit:
                break
            batch = to_device(self.collate_fn(take_rows(dataset, indices)), self.dist.device)
            sums += self.eval_batch_sums(batch, real)
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(sums)
        return sums

    def held_out_evaluation(self, width: int,
                            means: Callable[[torch.Tensor], dict[str, float]],
                            log_all: bool = False) -> dict[str, float]:
        """Evaluate on the eval split: `means(sums)` turns the summed tensor into the
        `eval_`-prefixed numbers (eval_loss among them), which go to the monitor and the
        reporters (the logged row gets eval_loss alone, or all of them with `log_all`)."""
        with self.meter.pause(), self._eval_mode():
            sums = self.held_out_sums(self.eval_data, width)
        evaluated = means(sums)
        self.monitor.update(evaluated, self.progress.step)
        if self.reporters:
            self.reporters.on_log(self.state, evaluated if log_all
                                  else {"eval_loss": evaluated["eval_loss"]})
            self.reporters.on_evaluate(self.state, evaluated)
        return evaluated


def counted(losses_sum: torch.Tensor, real: int, stats: torch.Tensor) -> torch.Tensor:
    """[loss sum, real, *stats] as one float64 tensor on the stats' device."""
    return torch.cat([torch.stack([losses_sum.double(),
                                   torch.tensor(float(real), dtype=torch.float64,
                                                device=stats.device)]), stats.double()])
