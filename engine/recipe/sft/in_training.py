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

lm-evaluation-harness metrics named in the list (`harness.<task>.<metric>.<filter>`, as the
evaluate stage's eval.json spells them) run through engine.evaluation.harness, the evaluate
stage's own code, on the current weights with `limit` = eval.during_training_samples and
eval.harness's other settings: logged as `eval_harness.<task>.<metric>.<filter>` and, where
lm-eval gives one, `eval_harness.<task>.<metric>.<filter>_stderr`. lm-eval takes one process's
whole model: under DDP rank 0 runs the tasks on its replica (every rank holds the same
weights) and broadcasts the numbers once (the other ranks wait); sharded strategies are
refused at validate (finetune.config.compat). The random generators are left as they were.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.evaluation import harness as lm_harness
from engine.evaluation.bootstrap import bootstrap_seed, stderrs
from engine.kinds import kind_of
from engine.modeling.model import base_model
from engine.process.distributed import Dist
from engine.recipe.sft.heldout import generation_inputs
from engine.rollout.greedy import greedy_generate
from finetune.datatypes import DataContext
from finetune.datatypes.generations import (generation_metric_names, generation_rows,
                                            score_generations, training_subset)
from finetune.config.compat import harness_in_training
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
    """The subset's prompts, encoded once at setup (and the harness tasks resolved once);
    `measure(model)` generates and scores, and runs the harness tasks."""

    def __init__(self, cfg, root: Path, formatted: Path, tokenizer, dist: Dist,
                 labels: list[str] | None = None):
        self.cfg, self.tokenizer, self.dist, self.root = cfg, tokenizer, dist, root
        ev = cfg.eval
        self.harness = _HarnessMetrics(cfg, root, tokenizer, dist) if harness_in_training(
            cfg) else None
        self.generates = ev.during_training_metrics is True or len(
            harness_in_training(cfg)) < len(ev.during_training_metrics)
        if not self.generates:
            return
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
        """`eval_<metric>` and `eval_<metric>_stderr` for the subset (and the harness
        metrics), on every rank alike."""
        out = self._generated(model, amp) if self.generates else {}
        if self.harness is not None:
            out.update(self.harness.measure(model))
        return out

    def _generated(self, model: torch.nn.Module, amp: torch.dtype | None) -> dict[str, float]:
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


class _HarnessMetrics:
    """The harness metrics eval.during_training_metrics names: their tasks resolved once (on
    every rank, so a bad name stops them all), run on the main rank at each evaluation with
    eval.harness's settings and `limit` eval.during_training_samples, the numbers broadcast."""

    def __init__(self, cfg, root: Path, tokenizer, dist: Dist):
        self.cfg, self.root, self.tokenizer, self.dist = cfg, root, tokenizer, dist
        self.wanted = harness_in_training(cfg)
        names, self.manager = lm_harness.resolve_tasks(cfg.eval.harness.tasks, root)
        tasks = sorted({m.split(".")[1] for m in self.wanted})
        unknown = [t for t in tasks if t not in names]
        if unknown:
            raise PipelineError(f"eval.during_training_metrics: harness task {unknown[0]} is "
                                f"not one eval.harness.tasks runs (they are {', '.join(names)})")
        self.tasks = tasks
        self.checked = False

    def measure(self, model: torch.nn.Module) -> dict[str, float]:
        d = self.dist
        box: list = [None]
        if d.is_main:
            try:
                box[0] = self._run(model)
            except PipelineError as error:  # said once on every rank, not a hang
                box[0] = error
        if d.world_size > 1:
            torch.distributed.broadcast_object_list(box, src=d.main_rank)
        if isinstance(box[0], PipelineError):
            raise box[0]
        return box[0]

    def _run(self, model: torch.nn.Module) -> dict[str, float]:
        h = self.cfg.eval.harness
        results = lm_harness.run_tasks(
            base_model(model), self.tokenizer, self.root, self.tasks, self.manager,
            batch_size=h.batch_size, num_fewshot=h.num_fewshot,
            limit=self.cfg.eval.during_training_samples,
            apply_chat_template=h.apply_chat_template, max_gen_toks=h.max_gen_toks)
        flat = lm_harness.flatten(results["results"])
        out = {}
        for name in self.wanted:
            if name not in flat:
                reported = sorted(k for k in flat if "_stderr." not in k)
                raise PipelineError(f"eval.during_training_metrics: {name} is not a metric "
                                    f"its task reported (it reported {', '.join(reported)})")
            out[f"eval_{name}"] = round(flat[name], 6)  # as the evaluate stage writes it
            stderr = flat.get(lm_harness.stderr_name(name))
            if stderr is not None:
                out[f"eval_{name}_stderr"] = round(stderr, 6)
        if not self.checked:
            self._check_direction(results)
            self.checked = True
        return out

    def _check_direction(self, results: dict) -> None:
        """metric_for_best_model on a harness metric: lm-eval's own higher_is_better agrees
        with the direction the run ranks by (derived from the name when greater_is_better is
        unset), or one line."""
        ck = self.cfg.checkpoint
        metric = ck.metric_for_best_model or ""
        if not metric.startswith("eval_harness.") or ck.greater_is_better is not None:
            return
        own = lm_harness.higher_is_better(results, metric.removeprefix("eval_"))
        if own is not None and own != ck.higher_wins:
            raise PipelineError(f"checkpoint.greater_is_better: lm-eval ranks {metric} "
                                f"{'higher' if own else 'lower'} as better; set "
                                f"checkpoint.greater_is_better: {str(own).lower()}")
