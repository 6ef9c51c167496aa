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

import functools

import torch

from engine.datapath.data import model_inputs
from engine.modeling.runtime import activation_offloading
from engine.recipe.heldout_sums import HeldOutSums, counted
from engine.recipe.reward.batches import REWARD_COLUMNS, collate_rewarded
from engine.recipe.reward.heldout import reward_metrics
from engine.recipe.reward.loss import LOGGED, bradley_terry
from engine.recipe.run import TrainingRun
from finetune.config.reward import REWARD_LABEL


class RewardRun(HeldOutSums, TrainingRun):
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
        def means(sums: torch.Tensor) -> dict[str, float]:
            n = max(float(sums[1]), 1.0)
            return {"eval_loss": float(sums[0]) / n,
                    **{f"eval_{name}": float(v) / n for name, v in zip(LOGGED, sums[2:])}}

        return self.held_out_evaluation(2 + len(LOGGED), means, log_all=True)

    def eval_batch_sums(self, batch: dict, real: int) -> torch.Tensor:
        """[loss sum, pairs, *LOGGED sums] of a held-out batch's first `real` pairs."""
        pairs = self._pairs(batch)
        if real < len(pairs.losses):  # padding pairs (an uneven last share): not counted
            pairs = type(pairs)(*(x[:real] for x in vars(pairs).values()))
        return counted(pairs.losses.sum(), real, pairs.sums())

    # -- the evaluate stage ----------------------------------------------------------------
    @classmethod
    def heldout_metrics(cls, held, after_loss=None):
        return reward_metrics(held)
