"""`training.type: dpo`: the SFT run with a preference objective (engine.recipe.dpo.loss).

What changes from `TrainingRun`, through its hooks only (the loop, the strategies, checkpoints
and resume are the SFT run's):
- `columns`: the split's rejected side is read next to the chosen one;
- batches: each micro-batch of b pairs is collated as 2b rows, chosen first
  (engine.recipe.dpo.batches), so one forward of the policy scores both sides;
- `count_targets`: the step's loss is the mean over its pairs (all micro-batches, all ranks),
  so accumulating 2 x batch b is batch 2b;
- `micro_step`: the policy's and the reference's sequence log-probabilities, the per-pair
  losses, and the reward statistics TRL logs (`window_metrics`);
- `evaluate`: the held-out pairs' loss and reward statistics;
- `heldout_metrics`: the evaluate stage's numbers, the SFT run's plus how each model ranks the
  held-out pairs (engine.recipe.dpo.heldout).

The reference is engine.recipe.reference's (the base: the adapter disabled under PEFT, a frozen
copy for full fine-tuning). With `dpo.precompute_ref_log_probs` it scores every training pair
once before the first step. A reference-free loss (simpo, orpo) loads no reference at all;
orpo's chosen-side NLL comes from the policy's same forward (`_policy_logps`).
"""

from __future__ import annotations

import functools

import torch

from engine.datapath.data import (IGNORE_INDEX, load_tokenized, model_inputs, take_rows,
                                  to_device)
from engine.modeling.runtime import activation_offloading
from engine.objective.logprobs import next_token_logps, sequence_logps
from engine.recipe.dpo.batches import PAIR_COLUMNS, collate_pairs
from engine.recipe.dpo.heldout import rank_pairs
from engine.recipe.dpo.loss import chosen_nll, logged, preference_loss
from engine.recipe.heldout_sums import HeldOutSums, counted
from engine.recipe.reference import Reference, ReferenceTable
from engine.recipe.run import TrainingRun


class DPORun(HeldOutSums, TrainingRun):
    """A preference run: see the module docstring."""

    columns = PAIR_COLUMNS

    def prepare_model(self) -> None:
        super().prepare_model()
        self.collate_fn = functools.partial(collate_pairs, collate_fn=self.collate_fn)
        self.reference = Reference.of(self) if self.cfg.dpo.uses_reference else None
        self.pair_stats = logged(self.cfg.dpo)
        self.pair_sums = torch.zeros(len(self.pair_stats), dtype=torch.float64,
                                     device=self.dist.device)
        self.ref_table: ReferenceTable | None = None

    def setup(self) -> None:
        super().setup()
        if self.cfg.dpo.precompute_ref_log_probs:
            with self._eval_mode():
                train = load_tokenized(self.paths.train_data, self.columns)
                self.ref_table = self.reference.precompute(
                    train, self._pair_batch, self._pair_scores, 2,
                    self.cfg.training.per_device_eval_batch_size, self.dist, self.log, "pairs")

    # -- the objective ---------------------------------------------------------------------
    def count_targets(self, host_batch: dict) -> int:
        return int(host_batch["pairs"])

    def window_metrics(self) -> dict[str, torch.Tensor]:
        sums, self.pair_sums = self.pair_sums, torch.zeros_like(self.pair_sums)
        return dict(zip(self.pair_stats, sums))

    def micro_step(self, host_labels: torch.Tensor, batch: dict, divisor) -> torch.Tensor:
        """Forward both sides of the micro-batch's pairs, backward the summed pair losses over
        `divisor` (the step's pair count); returns that sum."""
        t, device = self.cfg.training, self.dist.device
        ref = self._reference_logps(batch)
        with activation_offloading(t, device):
            logps, counts, nll = self._policy_logps(batch)
            pairs = preference_loss(self.cfg.dpo, logps, counts, ref, nll)
            loss_sum = pairs.losses.sum()
            loss = loss_sum / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.pair_sums += pairs.sums()
        return loss_sum

    def _logits(self, model, batch: dict) -> torch.Tensor:
        device = self.dist.device
        with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
            return model(**model_inputs(batch), use_cache=False).logits

    def _logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return sequence_logps(self._logits(model, batch), batch["labels"])

    def _policy_logps(self, batch: dict
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The policy's (logps, counts) of the 2b rows, and for orpo each chosen side's NLL
        (prompt included) from the same log-softmax: every next token's log-probability once,
        the trained ones (labels, which are the input ids where trained) summed apart."""
        if self.cfg.dpo.loss_type != "orpo":
            return *self._logps(self.model, batch), None
        per_token = next_token_logps(self._logits(self.model, batch), batch["input_ids"])
        trained = batch["labels"][:, 1:] != IGNORE_INDEX
        return ((per_token * trained).sum(-1), trained.sum(-1),
                chosen_nll(per_token, batch["attention_mask"]))

    # -- the reference ---------------------------------------------------------------------
    def _pair_scores(self, model, batch: dict) -> torch.Tensor:
        """[b, 2]: a model's summed log-probabilities of each pair's chosen, rejected side."""
        return torch.stack(self._logps(model, batch)[0].chunk(2), dim=1)

    def _reference_logps(self, batch: dict) -> torch.Tensor | None:
        """The reference's 2b log-probabilities, chosen rows first (None: reference-free)."""
        if self.reference is None:
            return None
        picked = (self.ref_table.lookup(batch) if self.ref_table is not None
                  else self.reference.score(self._pair_scores, batch))
        return torch.cat([picked[:, 0], picked[:, 1]])

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The held-out pairs' mean loss and TRL's reward statistics (`eval_` + name)."""
        def means(sums: torch.Tensor) -> dict[str, float]:
            n = max(float(sums[1]), 1.0)
            return {"eval_loss": float(sums[0]) / n,
                    **{f"eval_{name}": float(v) / n for name, v in zip(self.pair_stats, sums[2:])}}

        return self.held_out_evaluation(2 + len(self.pair_stats), means)

    def eval_batch_sums(self, batch: dict, real: int) -> torch.Tensor:
        """[loss sum, pairs, *logged sums] of a held-out batch's first `real` pairs."""
        ref = self._reference_logps_fresh(batch)
        logps, counts, nll = self._policy_logps(batch)
        pairs = preference_loss(self.cfg.dpo, logps, counts, ref, nll)
        if real < len(pairs.losses):  # padding pairs (an uneven last share): not counted
            pairs = pairs.first(real)
        return counted(pairs.losses.sum(), real, pairs.sums())

    def _reference_logps_fresh(self, batch: dict) -> torch.Tensor | None:
        """A held-out batch's reference log-probabilities (never from the training table)."""
        if self.reference is None:
            return None
        return torch.cat(self.reference.score(self._pair_scores, batch).unbind(1))

    def _pair_batch(self, dataset, indices: list[int]) -> dict:
        batch = self.collate_fn(take_rows(dataset, indices))
        return to_device(batch, self.dist.device)

    # -- the evaluate stage ----------------------------------------------------------------
    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        """The SFT run's numbers, and how the base and the fine-tuned model rank each
        held-out pair (engine.recipe.dpo.heldout.rank_pairs), before generation; then a
        subclass's own `after_loss`."""
        def ranked(held, results: dict) -> None:
            rank_pairs(held, results)
            if after_loss is not None:
                after_loss(held, results)

        return super().heldout_metrics(held, after_loss=ranked)
