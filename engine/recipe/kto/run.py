"""`training.type: kto`: the SFT run with TRL's KTO objective (engine.recipe.kto.loss) on
completions labelled desirable or not.

What changes from `TrainingRun`, through its hooks only (the loop, the strategies, checkpoints
and resume are the SFT run's):
- `columns`: the split's `desirable` label is read next to the tokens;
- batches: each micro-batch carries its mismatched rows for the KL estimate
  (engine.recipe.kto.batches);
- `prepare_step`: the step's KL estimate, from the mismatched rows of all its micro-batches on
  all ranks (policy and reference forwards without gradients), before any backward. With one
  micro-batch per step this is TRL's estimate (the batch's mean, averaged over ranks, clamped
  at 0); with accumulation it is the step's, so accumulating 2 x batch b on one process is 2
  processes x batch b;
- `count_targets`: the step's loss is the mean over its rows (all micro-batches, all ranks);
- `micro_step`: the policy's and the reference's log-probabilities of the completions, the
  per-row losses and TRL's statistics (`window_metrics`, averaged per label by
  `window_means`);
- `evaluate`: the held-out rows' loss and statistics (each batch its own KL estimate);
- `heldout_metrics`: the evaluate stage's numbers, the SFT run's plus whether each model's
  implicit reward puts the held-out completions on their label's side
  (engine.recipe.kto.heldout).

The reference is engine.recipe.reference's (the base: the adapter disabled under PEFT, a frozen
copy for full fine-tuning).
"""

from __future__ import annotations

import functools

import torch

from engine.datapath.data import model_inputs, to_device
from engine.modeling.runtime import activation_offloading
from engine.objective.logprobs import sequence_logps
from engine.recipe.kto.batches import KTO_COLUMNS, collate_unpaired, mismatched
from engine.recipe.kto.heldout import rank_rows
from engine.recipe.kto.loss import (
    LOGGED,
    SUMS,
    clamped_mean,
    kl_estimate,
    kto_loss,
    window_means,
)
from engine.recipe.heldout_sums import HeldOutSums, counted
from engine.recipe.reference import Reference
from engine.recipe.run import TrainingRun


class KTORun(HeldOutSums, TrainingRun):
    """A KTO run: see the module docstring."""

    columns = KTO_COLUMNS

    def prepare_model(self) -> None:
        super().prepare_model()
        self.collate_fn = functools.partial(collate_unpaired, collate_fn=self.collate_fn,
                                            max_len=self.cfg.data.max_seq_length)
        self.reference = Reference.of(self)
        self.row_sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.dist.device)
        self.step_kl = torch.zeros((), dtype=torch.float64, device=self.dist.device)

    # -- the objective ---------------------------------------------------------------------
    def count_targets(self, host_batch: dict) -> int:
        return int(host_batch["desirable"].numel())

    def prepare_step(self, micro: list[dict]) -> list[dict]:
        """The step's KL estimate (`step_kl`), before its first backward."""
        with torch.no_grad():
            sums = sum(self._kl_sums(to_device(b, self.dist.device)) for b in micro)
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(sums)
        self.step_kl = clamped_mean(sums)
        return micro

    def window_metrics(self) -> dict[str, torch.Tensor]:
        sums, self.row_sums = self.row_sums, torch.zeros_like(self.row_sums)
        return dict(zip(SUMS, sums))

    def window_means(self, sums: dict[str, float], targets: float) -> dict[str, float]:
        return window_means(sums)

    def micro_step(self, host_labels: torch.Tensor, batch: dict, divisor) -> torch.Tensor:
        """Forward the micro-batch's completions, backward the summed row losses over
        `divisor` (the step's row count); returns that sum."""
        ref = self.reference.score(self._row_logps, batch)
        with activation_offloading(self.cfg.training, self.dist.device):
            out = kto_loss(self.cfg.kto, self._row_logps(self.model, batch), ref,
                           batch["desirable"], self.step_kl)
            loss_sum = out.losses.sum()
            loss = loss_sum / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.row_sums += out.sums()
        return loss_sum

    def _row_logps(self, model, batch: dict) -> torch.Tensor:
        """[b]: a model's summed log-probability of each row's trained tokens."""
        device = self.dist.device
        with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
            logits = model(**model_inputs(batch), use_cache=False).logits
        return sequence_logps(logits, batch["labels"])[0]

    def _kl_sums(self, batch: dict, real: int | None = None) -> torch.Tensor:
        """[log-ratio sum, rows] of the batch's first `real` mismatched rows (all: None)."""
        kl_batch = mismatched(batch)
        policy = self._row_logps(self.model, kl_batch)
        ref = self.reference.score(self._row_logps, kl_batch)
        return kl_estimate(policy[:real], ref[:real])

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The held-out rows' mean loss and TRL's statistics (`eval_` + name)."""
        def means(sums: torch.Tensor) -> dict[str, float]:
            return {"eval_loss": float(sums[0]) / max(float(sums[1]), 1.0),
                    **{f"eval_{k}": v for k, v in window_means(
                        dict(zip(SUMS, sums[2:].tolist()))).items()}}

        return self.held_out_evaluation(2 + len(SUMS), means)

    def eval_batch_sums(self, batch: dict, real: int) -> torch.Tensor:
        """[loss sum, rows, *SUMS] of a held-out batch's first `real` rows; the batch's KL
        estimate is its own (all ranks' rows of that batch)."""
        kl = self._kl_sums(batch, real)
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(kl)
        out = kto_loss(self.cfg.kto, self._row_logps(self.model, batch)[:real],
                       self.reference.score(self._row_logps, batch)[:real],
                       batch["desirable"][:real], clamped_mean(kl))
        return counted(out.losses.sum(), real, out.sums())

    # -- the evaluate stage ----------------------------------------------------------------
    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        """The SFT run's numbers, and where each model's implicit reward puts the held-out
        completions (engine.recipe.kto.heldout.rank_rows), before generation; then a
        subclass's own `after_loss`."""
        def ranked(held, results: dict) -> None:
            rank_rows(held, results)
            if after_loss is not None:
                after_loss(held, results)

        return super().heldout_metrics(held, after_loss=ranked)
