"""GRPO's held-out numbers: what the reward functions say of a model's completions of held-out
prompts. For the evaluate stage, base and fine-tuned: each reward's mean on greedy completions
(`reward_NAME`) and on k completions sampled as in training (`sampled_reward_NAME`), the
weighted totals (`reward`, `sampled_reward`), and with the correctness reward its pass rate greedy
(`pass_at_1`) and over k sampled completions (`pass_at_k`, k = grpo.num_generations_eval: a
prompt passes when any of its k completions is correct). In training, the greedy rewards of
the first eval.eval_batches batches (`eval_reward`).

Scoring is shared with the training rollout (`score_completions`), so a reward means the same
in training, in evaluation and in the registry gate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.datapath.data import take_rows
from engine.evaluation.heldout import Evaluated
from engine.recipe.grpo.generation import Completions, LocalGenerator, SamplingParams, left_pad
from engine.recipe.grpo.rewards import RewardOptions, load_reward_functions, score
from engine.recipe.reference import lockstep_batches


def reward_options(cfg, root: Path = Path("."), device: torch.device | None = None
                   ) -> RewardOptions:
    """What the built-in rewards read from the config; a reward model's directory resolves
    against `root` and loads on `device` (CPU when None)."""
    g = cfg.grpo
    return RewardOptions(answer_regex=cfg.eval.answer_regex,
                         reference_column=g.reference_column, format_regex=g.format_regex,
                         max_completion_length=g.max_completion_length, root=Path(root),
                         device=device or torch.device("cpu"),
                         batch_size=cfg.training.per_device_eval_batch_size)


def sampling_params(g, greedy: bool = False) -> SamplingParams:
    return SamplingParams(max_completion_length=g.max_completion_length,
                          temperature=0.0 if greedy else g.temperature, top_p=g.top_p,
                          top_k=g.top_k, repetition_penalty=g.repetition_penalty)


def eos_ids(tokenizer, model) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)


def score_completions(tokenizer, funcs, reward_inputs: list[str], done: Completions,
                      repeat: int, trainer_state: Any = None
                      ) -> tuple[torch.Tensor, list, list[str]]:
    """([rows * repeat, functions] rewards, the prompts, the completion texts) of `done`, the
    `repeat` completions of each row (rows' order, TRL's): the reward functions get the prompt
    (a conversation stays a message list, and its completion is one too), the completion,
    its token ids and every other column of the row."""
    rows = [json.loads(r) for r in reward_inputs]
    prompts = [row["prompt"] for row in rows for _ in range(repeat)]
    keys = dict.fromkeys(k for row in rows for k in row if k != "prompt")
    columns = {key: [row.get(key) for row in rows for _ in range(repeat)] for key in keys}
    lengths = done.mask.sum(-1).tolist()
    completion_ids = [ids[:n] for ids, n in zip(done.ids.tolist(), lengths)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": text}] if isinstance(p, list) else text
                   for text, p in zip(texts, prompts)]
    rewards = score(funcs, prompts, completions, completion_ids, columns,
                    trainer_state=trainer_state)
    return rewards, prompts, texts


def _weighted(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (per_func * weights.unsqueeze(0)).nansum(dim=1)


class _Measure:
    """Greedy and sampled completions of held-out prompts, scored."""

    def __init__(self, cfg, tokenizer, model, seed: int, funcs, all_finished=None):
        g = cfg.grpo
        self.cfg, self.tok, self.model, self.seed = cfg, tokenizer, model, seed
        self.funcs = funcs  # loaded once per run or stage (a reward model is a model)
        self.weights = torch.tensor(g.reward_weights or [1.0] * len(self.funcs))
        self.names = [f.name for f in self.funcs]
        eos, pad = eos_ids(tokenizer, model), tokenizer.pad_token_id
        self.greedy = LocalGenerator(model, sampling_params(g, greedy=True), eos, pad,
                                     all_finished=all_finished)
        self.sampled = LocalGenerator(model, sampling_params(g), eos, pad,
                                      all_finished=all_finished)

    def batch(self, rows: list[dict], k: int | None, offset: int):
        """(greedy rewards [b, F], greedy texts, sampled rewards [b * k, F] or None)."""
        device = next(self.model.parameters()).device
        ids, mask = left_pad([r["input_ids"] for r in rows], self.tok.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        inputs = [r["reward_inputs"] for r in rows]
        done = self.greedy.generate(ids, mask, 1, self.seed + offset)
        greedy, _, texts = score_completions(self.tok, self.funcs, inputs, done, 1)
        sampled = None
        if k:
            done = self.sampled.generate(ids, mask, k, self.seed + offset)
            sampled = score_completions(self.tok, self.funcs, inputs, done, k)[0]
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
    g, ev = cfg.grpo, cfg.eval
    n = len(held.test) if not ev.max_generation_samples else min(len(held.test),
                                                                  ev.max_generation_samples)
    rows = take_rows(held.test, range(n))
    size = cfg.training.per_device_eval_batch_size
    k = g.num_generations_eval
    seed = cfg.training.seed or 0
    results, texts = {}, {}
    funcs = load_reward_functions(g.reward_funcs, reward_options(
        cfg, held.root, next(held.base.parameters()).device))
    for name, model in (("base", held.base), ("finetuned", None)):
        model = model if model is not None else held.tuned()
        measure = _Measure(cfg, held.tokenizer, model, seed, funcs)
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
                       all_finished=run.strategy.generation_done)
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
