"""`training.type: dpo`: the SFT run with a preference objective (engine.objective.preference).

What changes from `TrainingRun`, through its hooks only (the loop, the strategies, checkpoints
and resume are the SFT run's):
- batches: each micro-batch of b pairs is collated as 2b rows, chosen first
  (`collate_pairs`), so one forward of the policy scores both sides;
- `count_targets`: the step's loss is the mean over its pairs (all micro-batches, all ranks),
  so accumulating 2 x batch b is batch 2b;
- `micro_step`: the policy's and the reference's sequence log-probabilities, the per-pair
  losses, and the reward statistics TRL logs (`window_metrics`);
- `evaluate`: the held-out pairs' loss and reward statistics.

The reference is the base model: under PEFT the policy itself with its adapter disabled (no
second copy in memory, TRL's way), for full fine-tuning a frozen copy of the base loaded once
(each rank holds a whole copy, also under FSDP2). With `dpo.precompute_ref_log_probs` the
reference scores every training pair once before the first step, and each step then reads its
pairs' values from that table (by the rows the loader took). A reference-free loss (simpo)
needs no reference at all.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from engine.datapath.data import (
    collate_pairs,
    load_tokenized,
    model_inputs,
    take_rows,
    to_device,
)
from engine.modeling.adapter import adapter_disabled, has_adapter
from engine.modeling.model import load_base_model
from engine.modeling.runtime import activation_offloading
from engine.objective.preference import LOGGED, preference_loss, sequence_logps
from engine.recipe.run import TrainingRun


class DPORun(TrainingRun):
    """A preference run: see the module docstring."""

    def prepare_model(self) -> None:
        super().prepare_model()
        self.collate_fn = functools.partial(collate_pairs, collate_fn=self.collate_fn)
        self.frozen_reference = None
        if self.cfg.dpo.uses_reference and not has_adapter(self.strategy.module):
            self.frozen_reference = self._load_frozen_reference()
        self.pair_sums = torch.zeros(len(LOGGED), dtype=torch.float64, device=self.dist.device)
        self.ref_table: torch.Tensor | None = None

    def setup(self) -> None:
        super().setup()
        if self.cfg.dpo.precompute_ref_log_probs:
            with self._eval_mode():
                self.ref_table = self._precompute_reference()

    # -- the objective ---------------------------------------------------------------------
    def count_targets(self, host_batch: dict) -> int:
        return int(host_batch["pairs"])

    def window_metrics(self) -> dict[str, torch.Tensor]:
        sums, self.pair_sums = self.pair_sums, torch.zeros_like(self.pair_sums)
        return dict(zip(LOGGED, sums))

    def micro_step(self, host_labels: torch.Tensor, batch: dict, divisor) -> torch.Tensor:
        """Forward both sides of the micro-batch's pairs, backward the summed pair losses over
        `divisor` (the step's pair count); returns that sum."""
        t, device = self.cfg.training, self.dist.device
        ref = self._reference_logps(batch)
        with activation_offloading(t, device):
            logps, counts = self._logps(self.model, batch)
            pairs = preference_loss(self.cfg.dpo, logps, counts, ref)
            loss_sum = pairs.losses.sum()
            loss = loss_sum / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.pair_sums += pairs.sums()
        return loss_sum

    def _logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.dist.device
        with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
            logits = model(**model_inputs(batch), use_cache=False).logits
        return sequence_logps(logits, batch["labels"])

    # -- the reference ---------------------------------------------------------------------
    def _load_frozen_reference(self) -> torch.nn.Module:
        model = load_base_model(self.cfg.model, self.paths.project_root)
        return model.to(self.dist.device).eval().requires_grad_(False)

    @torch.no_grad()
    def _reference_forward(self, batch: dict) -> torch.Tensor:
        """The reference's summed log-probabilities of the batch's rows."""
        if self.frozen_reference is not None:
            return self._logps(self.frozen_reference, batch)[0]
        with adapter_disabled(self.strategy.module):
            return self._logps(self.strategy.module, batch)[0]

    def _reference_logps(self, batch: dict) -> torch.Tensor | None:
        if not self.cfg.dpo.uses_reference:
            return None
        if self.ref_table is None:
            return self._reference_forward(batch)
        picked = self.ref_table[batch["rows"]]  # [b, 2]: chosen, rejected
        return torch.cat([picked[:, 0], picked[:, 1]])

    def _precompute_reference(self) -> torch.Tensor:
        """[rows, 2] reference log-probabilities of every training pair: each rank scores its
        share, the table is summed over ranks (every row is written by one rank)."""
        train = load_tokenized(self.paths.train_data)
        table = torch.zeros(len(train), 2, dtype=torch.float32, device=self.dist.device)
        size = self.cfg.training.per_device_eval_batch_size
        for indices, real in self._rank_batches(len(train), size):
            batch = self._pair_batch(train, indices)
            chosen, rejected = self._reference_forward(batch).chunk(2)
            keep = indices[:real]
            table[keep] = torch.stack([chosen[:real], rejected[:real]], dim=1).float()
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(table)
        self.log(f"[train] reference log-probabilities of {len(train)} pairs precomputed")
        return table

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The held-out pairs' mean loss and TRL's reward statistics (`eval_` + name)."""
        with self.meter.pause(), self._eval_mode():
            sums = self._score_pairs(self.eval_data)
        n = max(float(sums[1]), 1.0)
        evaluated = {"eval_loss": float(sums[0]) / n,
                     **{f"eval_{name}": float(v) / n for name, v in zip(LOGGED, sums[2:])}}
        self.monitor.update(evaluated, self.progress.step)
        if self.reporters:
            self.reporters.on_log(self.state, {"eval_loss": evaluated["eval_loss"]})
            self.reporters.on_evaluate(self.state, evaluated)
        return evaluated

    @contextlib.contextmanager
    def _eval_mode(self):
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    @torch.no_grad()
    def _score_pairs(self, dataset) -> torch.Tensor:
        """[loss sum, pairs, *LOGGED sums] over this split's pairs (the first
        eval.eval_batches batches per rank when set), summed over ranks."""
        size = self.cfg.training.per_device_eval_batch_size
        limit = self.cfg.eval.eval_batches
        sums = torch.zeros(2 + len(LOGGED), dtype=torch.float64, device=self.dist.device)
        for k, (indices, real) in enumerate(self._rank_batches(len(dataset), size)):
            if limit is not None and k >= limit:
                break
            batch = self._pair_batch(dataset, indices)
            ref = (self._reference_forward(batch) if self.cfg.dpo.uses_reference else None)
            logps, counts = self._logps(self.model, batch)
            pairs = preference_loss(self.cfg.dpo, logps, counts, ref)
            if real < len(indices):  # padding pairs (an uneven last share): not counted
                pairs = type(pairs)(*(x[:real] for x in vars(pairs).values()))
            sums += torch.cat([torch.stack([pairs.losses.sum().double(),
                                            torch.tensor(float(real), dtype=torch.float64,
                                                         device=sums.device)]),
                               pairs.sums()])
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(sums)
        return sums

    def _rank_batches(self, rows: int, size: int):
        """(row indices, how many are real) of this rank's batches over `rows` rows: rank r
        takes rows r, r + world, ...; every rank runs the same number of batches (a sharded
        model's forward is a collective), the short ones padded with row 0."""
        world, rank = self.dist.world_size, self.dist.rank
        mine = list(range(rank, rows, world))
        per_rank = -(-rows // world)
        for start in range(0, per_rank, size):
            chunk = mine[start:start + size]
            width = min(size, per_rank - start)
            yield chunk + [0] * (width - len(chunk)), len(chunk)

    def _pair_batch(self, dataset, indices: list[int]) -> dict:
        batch = self.collate_fn(take_rows(dataset, indices))
        return to_device(batch, self.dist.device)
