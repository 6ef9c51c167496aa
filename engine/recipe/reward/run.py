"""`training.type: reward`: the SFT run training a reward model (engine.recipe.reward.loss).

The model is a sequence classifier with one output (finetune.config.reward registers the
method's model task; the run names the head's one label, `reward`, so the head is sized to it
and the label map travels with the weights: export and evaluate load it as a classifier).
Under PEFT the task is SEQ_CLS, which trains the new head in full (modules_to_save) beside the
adapter. What changes from `TrainingRun`, through its hooks only:
- `columns`: the rejected side and the optional `margin` are read next to the chosen side;
- batches: b pairs as 2b rows, chosen first (engine.recipe.reward.batches), one forward;
- `count_targets`: the step's loss is the mean over its pairs (all micro-batches, all ranks);
- `micro_step`: the rewards, the Bradley-Terry losses and TRL's statistics (`window_metrics`);
- `evaluate`: the held-out pairs' loss and statistics (`eval_` + name);
- `heldout_metrics`: the evaluate stage's numbers (engine.recipe.reward.heldout).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from engine.datapath.data import model_inputs, take_rows, to_device
from engine.modeling.runtime import activation_offloading
from engine.recipe.reference import lockstep_batches
from engine.recipe.reward.batches import REWARD_COLUMNS, collate_rewarded
from engine.recipe.reward.heldout import reward_metrics
from engine.recipe.reward.loss import LOGGED, bradley_terry
from engine.recipe.run import TrainingRun
from finetune.config.reward import REWARD_LABEL


class RewardRun(TrainingRun):
    """A reward model's run: see the module docstring."""

    columns = REWARD_COLUMNS

    def prepare_model(self) -> None:
        self.labels = [REWARD_LABEL]  # a one-output head, its label map saved with it
        super().prepare_model()
        self.collate_fn = functools.partial(collate_rewarded, collate_fn=self.collate_fn)
        self.pair_sums = torch.zeros(len(LOGGED), dtype=torch.float64, device=self.dist.device)

    def count_targets(self, host_batch: dict) -> int:
        return int(host_batch["pairs"])

    def window_metrics(self) -> dict[str, torch.Tensor]:
        sums, self.pair_sums = self.pair_sums, torch.zeros_like(self.pair_sums)
        return dict(zip(LOGGED, sums))

    def _pairs(self, batch: dict):
        device = self.dist.device
        with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
            rewards = self.model(**model_inputs(batch), use_cache=False).logits
        return bradley_terry(rewards, batch.get("margin"),
                             self.cfg.reward.center_rewards_coefficient)

    def micro_step(self, host_labels: torch.Tensor, batch: dict, divisor) -> torch.Tensor:
        """Score both sides of the micro-batch's pairs, backward the summed pair losses over
        `divisor` (the step's pair count); returns that sum."""
        with activation_offloading(self.cfg.training, self.dist.device):
            pairs = self._pairs(batch)
            loss_sum = pairs.losses.sum()
            loss = loss_sum / divisor
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.pair_sums += pairs.sums()
        return loss_sum

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The held-out pairs' mean loss and TRL's statistics (`eval_` + name), all of them in
        the logged row (console, MLflow; eval.csv keeps eval_loss), as TRL logs them."""
        with self.meter.pause(), self._eval_mode():
            sums = self._score_pairs(self.eval_data)
        n = max(float(sums[1]), 1.0)
        evaluated = {"eval_loss": float(sums[0]) / n,
                     **{f"eval_{name}": float(v) / n for name, v in zip(LOGGED, sums[2:])}}
        self.monitor.update(evaluated, self.progress.step)
        if self.reporters:
            self.reporters.on_log(self.state, evaluated)
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
        batches = lockstep_batches(len(dataset), size, self.dist.rank, self.dist.world_size)
        for k, (indices, real) in enumerate(batches):
            if limit is not None and k >= limit:
                break
            batch = to_device(self.collate_fn(take_rows(dataset, indices)), self.dist.device)
            pairs = self._pairs(batch)
            if real < len(indices):  # padding pairs (an uneven last share): not counted
                pairs = type(pairs)(*(x[:real] for x in vars(pairs).values()))
            sums += torch.cat([torch.stack([pairs.losses.sum().double(),
                                            torch.tensor(float(real), dtype=torch.float64,
                                                         device=sums.device)]),
                               pairs.sums()])
        if self.dist.world_size > 1:
            torch.distributed.all_reduce(sums)
        return sums

    # -- the evaluate stage ----------------------------------------------------------------
    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        return reward_metrics(held)
