"""GRPO's held-out numbers: what the reward functions say of a model's completions of held-out
prompts. For the evaluate stage, base and fine-tuned: each reward's mean on greedy completions
(`reward_NAME`) and on k completions sampled as in training (`sampled_reward_NAME`), the
weighted totals (`reward`, `sampled_reward`), and with the correctness reward its pass rate greedy
(`pass_at_1`) and over k sampled completions (`pass_at_k`, k = num_generations_eval: a
prompt passes when any of its k completions is correct). In training, the greedy rewards of
the first eval.eval_batches batches (`eval_reward`).

Scoring is shared with the training rollout (engine.rollout.scoring.score_completions), so a
reward means the same in training, in evaluation and in the registry gate.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.datapath.data import take_rows
from engine.evaluation.heldout import Evaluated
from engine.recipe.grpo.rollouts import (environment_rewards, key, load_grpo_environments,
                                         make_episodes, reward_weights)
from engine.recipe.reference import lockstep_batches
from engine.rollout.generator import left_pad
from engine.rollout.local import LocalGenerator, eos_ids
from engine.rollout.rewards import RewardFunction, load_reward_functions, reward_options
from engine.rollout.sampling import sampling_params
from engine.rollout.scoring import score_completions
from finetune.config.rollout import rollout_section
from finetune.errors import PipelineError


def rewards_key(cfg) -> str:
    """The config key of the reward functions, which the rollout's messages name."""
    return key(cfg, "reward_funcs")


def load_rewards(cfg, root: Path = Path("."), device: torch.device | None = None,
                 environments=None) -> list[RewardFunction]:
    """The section's reward_funcs as functions, with what the built-ins read from the config; a reward
    model's directory resolves against `root` and loads on `device` (CPU when None); then a
    function per environment class of `environments` that owns its reward (TRL's order)."""
    g = rollout_section(cfg)
    options = reward_options(g, answer_regex=cfg.eval.answer_regex,
                             batch_size=cfg.training.per_device_eval_batch_size, root=root,
                             device=device)
    funcs = (load_reward_functions(g.reward_funcs, options, key=rewards_key(cfg))
             + environment_rewards(environments))
    if not funcs:  # reward_funcs: [] is allowed (config) only beside an environment
        raise PipelineError(f"{rewards_key(cfg)} is empty and no environment of "
                            f"{key(cfg, 'environment_factory')} defines get_reward(): "
                            "nothing scores "
                            "the rollouts; name a reward function or add get_reward")
    return funcs


def _weighted(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (per_func * weights.unsqueeze(0)).nansum(dim=1)


class _Measure:
    """Greedy and sampled completions of held-out prompts, scored: episodes as in training
    (engine.recipe.grpo.rollouts: with tools or environments, the tool loop runs here too)."""

    def __init__(self, cfg, tokenizer, model, seed: int, funcs, all_finished=None,
                 root: Path = Path("."), environments=None):
        g = rollout_section(cfg)
        self.key = rewards_key(cfg)
        self.cfg, self.tok, self.model, self.seed = cfg, tokenizer, model, seed
        self.funcs = funcs  # loaded once per run or stage (a reward model is a model)
        self.weights = torch.tensor(reward_weights(cfg, len(self.funcs)))
        self.names = [f.name for f in self.funcs]
        eos, pad = eos_ids(tokenizer, model), tokenizer.pad_token_id
        self.greedy = make_episodes(cfg, tokenizer, LocalGenerator(
            model, sampling_params(g, greedy=True), eos, pad, all_finished=all_finished),
            root, environments)
        self.sampled = make_episodes(cfg, tokenizer, LocalGenerator(
            model, sampling_params(g), eos, pad, all_finished=all_finished), root, environments)

    def batch(self, rows: list[dict], k: int | None, offset: int):
        """(greedy rewards [b, F], greedy texts, sampled rewards [b * k, F] or None)."""
        device = next(self.model.parameters()).device
        ids, mask = left_pad([r["input_ids"] for r in rows], self.tok.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        inputs = [r["reward_inputs"] for r in rows]
        seed = self.seed + offset  # the call's (an environment run derives each row's)
        rolled = self.greedy.generate(ids, mask, inputs, 1, seed)
        greedy, _, texts = score_completions(self.tok, self.funcs, inputs, rolled.done, 1,
                                             key=self.key, prompts=rolled.prompts,
                                             environments=rolled.environments)
        sampled = None
        if k:
            rolled = self.sampled.generate(ids, mask, inputs, k, seed)
            sampled = score_completions(self.tok, self.funcs, inputs, rolled.done, k,
                                        key=self.key, prompts=rolled.prompts,
                                        environments=rolled.environments)[0]
        return greedy, texts, sampled


def _summary(names, weights, greedy: torch.Tensor, sampled: torch.Tensor | None, k: int
             ) -> dict[str, float]:
    out = {"reward": float(torch.nanmean(_weighted(greedy, weights)))}
    for i, name in enumerate(names):
        out[f"reward_{name}"] = float(torch.nanmean(greedy[:, i]))
    if sampled is not None:  # what training samples: the mean over k completions each
        out["sampled_reward"] = float(torch.nanmean(_weighted(sampled, weights)))
        for i, name in enumerate(names):
            out[f"sampled_reward_{name}"] = float(torch.nanmean(sampled[:, i]))
    if "correctness" in names:
        i = names.index("correctness")
        out["pass_at_1"] = float((greedy[:, i] >= 1.0).float().mean())
        if sampled is not None:
            hits = (sampled[:, i] >= 1.0).view(-1, k).any(dim=1)
            out[f"pass_at_{k}"] = float(hits.float().mean())
    return {key: round(v, 6) for key, v in out.items()}


def reward_metrics(held, after_loss=None) -> Evaluated:
    """The evaluate stage's numbers (see the module docstring); `after_loss(held, results)`:
    a subclass's own, once both models are measured."""
    cfg = held.cfg
    g, ev = rollout_section(cfg), cfg.eval
    n = len(held.test) if not ev.max_generation_samples else min(len(held.test),
                                                                  ev.max_generation_samples)
    rows = take_rows(held.test, range(n))
    size = cfg.training.per_device_eval_batch_size
    k = g.num_generations_eval
    seed = cfg.training.seed or 0
    results, texts = {}, {}
    environments = load_grpo_environments(cfg)
    funcs = load_rewards(cfg, held.root, next(held.base.parameters()).device, environments)
    for name, model in (("base", held.base), ("finetuned", None)):
        model = model if model is not None else held.tuned()
        measure = _Measure(cfg, held.tokenizer, model, seed, funcs, root=held.root,
                           environments=environments)
        greedy, sampled, generated = [], [], []
        with torch.no_grad():
            for start in range(0, n, size):
                g_rewards, g_texts, s_rewards = measure.batch(rows[start:start + size], k,
                                                              start)
                greedy.append(g_rewards)
                generated += g_texts
                if s_rewards is not None:
                    sampled.append(s_rewards)
        results[name] = _summary(measure.names, measure.weights, torch.cat(greedy),
                                 torch.cat(sampled) if sampled else None, k)
        texts[name] = generated
    if after_loss is not None:
        after_loss(held, results)
    samples = []
    for i, row in enumerate(rows[:ev.num_logged_samples]):
        inputs = json.loads(row["reward_inputs"])
        prompt = inputs["prompt"]
        samples.append({"prompt": prompt if isinstance(prompt, str) else json.dumps(prompt),
                        "reference": inputs.get(g.reference_column),
                        "generation": texts["finetuned"][i],
                        "base_generation": texts["base"][i]})
    return Evaluated(results, {"generation_rows": n}, samples)


@torch.no_grad()
def greedy_rewards(run, dataset) -> dict[str, float]:
    """In training: the greedy completions' rewards on the first eval.eval_batches batches of
    the held-out prompts (every rank its share, summed over ranks)."""
    cfg, d = run.cfg, run.dist
    module = run.strategy.module
    measure = _Measure(cfg, run.tokenizer, module, cfg.training.seed or 0, run.rewards,
                       all_finished=run.strategy.generation_done,
                       root=run.paths.project_root, environments=run.episodes.environments)
    size, limit = cfg.training.per_device_eval_batch_size, cfg.eval.eval_batches
    funcs = len(measure.funcs)
    sums = torch.zeros(2 + 2 * funcs, dtype=torch.float64, device=d.device)
    was_training = module.training
    module.eval()
    try:
        for b, (indices, real) in enumerate(lockstep_batches(len(dataset), size, d.rank,
                                                             d.world_size)):
            if limit is not None and b >= limit:
                break
            greedy = measure.batch(take_rows(dataset, indices), None, indices[0])[0][:real]
            greedy = greedy.to(d.device, torch.float64)
            total = _weighted(greedy, measure.weights.to(greedy))
            counted = (~torch.isnan(greedy)).to(torch.float64)
            sums += torch.cat([torch.stack([total.sum(), torch.tensor(
                float(real), dtype=torch.float64, device=d.device)]),
                greedy.nan_to_num().sum(0), counted.sum(0)])
    finally:
        module.train(was_training)
    if d.world_size > 1:
        torch.distributed.all_reduce(sums)
    n = max(float(sums[1]), 1.0)
    out = {"eval_reward": float(sums[0]) / n}
    for i, name in enumerate(measure.names):
        out[f"eval_rewards/{name}"] = float(sums[2 + i]) / max(float(sums[2 + funcs + i]), 1.0)
    return out
