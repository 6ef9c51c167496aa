"""Generation metrics during training (eval.during_training_metrics): at every in-training
evaluation, the current weights greedy-generate on a seeded subset of the evaluate stage's
generation rows, scored by the code the evaluate stage scores with
(finetune.datatypes.generations) and bootstrapped as it does (engine.evaluation.bootstrap),
so `eval_exact_match` at a step is the evaluate stage's `exact_match` on that step's weights
and the same rows.

Under several ranks, rank r generates rows r, r + world, ... (batched, engine.rollout.greedy);
the texts are gathered once (all_gather_object) and every rank scores them all, so every
rank's Monitor sees the same numbers and takes the same decision. Every rank runs the same
number of forwards, whatever the strategy (FSDP2 gathers its shards inside each forward, a
collective every rank must join; the strategy's flag is not read outside engine/strategies/):
a short rank generates its first row once more (not counted), and Hugging Face's `generate`
runs with `synced_gpus`, so no rank leaves the decode loop before the others (under DDP that
costs a one-element all-reduce per generated token and a few padding forwards).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.evaluation.bootstrap import bootstrap_seed, stderrs
from engine.kinds import kind_of
from engine.process.distributed import Dist
from engine.recipe.sft.heldout import generation_inputs
from engine.rollout.greedy import greedy_generate
from finetune.datatypes import DataContext
from finetune.datatypes.generations import (generation_metric_names, generation_rows,
                                            score_generations, training_subset)
from finetune.errors import PipelineError


class _SyncedGenerate:
    """The model, with `generate(synced_gpus=True)`: a rank whose rows finished keeps running
    forwards until every rank's did (the gathers inside FSDP2's forward are collectives).
    A model whose root is sharded (FSDP2's `fully_shard`, which has `unshard`) has its root's
    own parameters (embeddings, norm, head) gathered for the whole call: `generate` runs the
    wrapped transformers model's forward, not the root's, whose hook would gather them; each
    sharded block still gathers its own in its forward."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def generate(self, **kwargs):
        unshard = getattr(self._model, "unshard", None)
        if unshard is not None:
            unshard()
        try:
            return self._model.generate(synced_gpus=True, **kwargs)
        finally:
            if unshard is not None:
                self._model.reshard()

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class GenerationMetrics:
    """The subset's prompts, encoded once at setup; `measure(model)` generates and scores."""

    def __init__(self, cfg, root: Path, formatted: Path, tokenizer, dist: Dist,
                 labels: list[str] | None = None):
        self.cfg, self.tokenizer, self.dist = cfg, tokenizer, dist
        ev = cfg.eval
        self.rows = training_subset(generation_rows(cfg, formatted), ev.during_training_samples,
                                    cfg.training.seed)
        if self.rows.empty:
            raise PipelineError(f"eval.during_training_metrics: {formatted} holds no generation "
                                "rows (an empty test split); set it to false")
        n, world, rank = len(self.rows), dist.world_size, dist.rank
        mine = list(range(rank, n, world))
        self.count = len(mine)  # this rank's rows; the rest is lockstep padding
        rounds = -(-n // world)  # lockstep: every rank as many rows
        taken = mine + [mine[0] if mine else 0] * (rounds - len(mine))
        self.prompts, self.extras = generation_inputs(cfg, root, tokenizer,
                                                      self.rows.iloc[taken].reset_index(drop=True))
        self.ctx = DataContext(root, lambda: tokenizer, labels=labels)
        #: a list in eval.during_training_metrics logs only what it names (None: all scored)
        self.logged = (set(generation_metric_names(cfg))
                       if isinstance(ev.during_training_metrics, list) else None)

    def measure(self, model: torch.nn.Module, amp: torch.dtype | None = None
                ) -> dict[str, float]:
        """`eval_<metric>` and `eval_<metric>_stderr` for the subset, on every rank alike."""
        cfg, d = self.cfg, self.dist
        generator = _SyncedGenerate(model) if d.world_size > 1 else model
        device = next(model.parameters()).device
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            texts = greedy_generate(generator, self.tokenizer, self.prompts,
                                    cfg.training.per_device_eval_batch_size,
                                    cfg.eval.generation_max_new_tokens, device=device,
                                    generated_from=kind_of(cfg).generated_from,
                                    extras=self.extras)[:self.count]
        if d.world_size > 1:  # once per evaluation: rank r's texts are rows r, r + world, ...
            gathered: list[list[str] | None] = [None] * d.world_size
            torch.distributed.all_gather_object(gathered, texts)
            ordered = [""] * len(self.rows)
            for r, part in enumerate(gathered):
                ordered[r::d.world_size] = part
            texts = ordered
        scores, per_row = score_generations(cfg, self.rows, texts, self.ctx)
        if self.logged is not None:
            scores = {k: v for k, v in scores.items() if k in self.logged}
            per_row = {k: v for k, v in per_row.items() if k in self.logged}
        out = {f"eval_{k}": round(v, 6) for k, v in scores.items()}
        out.update({f"eval_{k}": v for k, v in stderrs(per_row, cfg.eval.bootstrap_samples,
                                                        bootstrap_seed(cfg)).items()})
        return out
