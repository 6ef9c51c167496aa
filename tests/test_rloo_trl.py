"""RLOO against TRL's RLOOTrainer as the oracle, as tests/test_grpo_trl.py does for GRPO: the
same model, prompts and completions (injected into TRL's generation) give the same
leave-one-out advantages (with the KL penalty on the reward, reward clipping and batch
normalisation), log-probabilities at generation, loss, gradients and logged statistics (kl,
entropy, clip ratios over completions, reward statistics), for beta 0 and > 0 and
num_iterations 1 and 2 (the second after the weights moved, so the sequence ratio is clipped).
Our settings are read off TRL's RLOOConfig through our section's names (RLOOConfig fields), so
a name of ours that is not TRL's fails here."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from engine.recipe.grpo.loss import completion_logps, stat_means, token_stat_sums
from engine.recipe.rloo.advantages import leave_one_out_advantages
from engine.recipe.rloo.loss import sequence_losses
from engine.rollout.generator import Completions
from engine.rollout.rewards import RewardFunction
from engine.rollout.scoring import score_completions
from finetune.config.rloo import RLOOConfig
from tests.test_grpo_trl import (GROUP, LENGTH, MODEL, PROMPTS, TEMPERATURE,  # noqa: F401
                                 base, injected_completions, last, ours_batch, reward_len,
                                 reward_vowels, trls_loss_and_gradients)

trl = pytest.importorskip("trl")


class Injected(trl.RLOOTrainer):
    """TRL's RLOO trainer with its sampling replaced by fixed completions."""

    injected: list[list[int]] = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        assert len(prompt_ids) == len(self.injected)
        return [list(ids) for ids in self.injected]


def trl_trainer(tmp_path, model, tok, **options):
    import datasets

    args = trl.RLOOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PROMPTS) * GROUP,
        num_generations=GROUP, max_completion_length=LENGTH, temperature=TEMPERATURE,
        epsilon=0.2, epsilon_high=0.28, gradient_accumulation_steps=1,
        reward_weights=[1.0, 0.5], report_to=[], use_cpu=True, max_steps=1, logging_steps=1,
        bf16=False, fp16=False, save_strategy="no", **options)
    data = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = Injected(model=model, reward_funcs=[reward_len, reward_vowels], args=args,
                       train_dataset=data, processing_class=tok)
    trainer.injected = injected_completions(tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


CASES = {
    "plain": {"beta": 0.0, "num_iterations": 1},
    "kl_penalty": {"beta": 0.05, "num_iterations": 1},
    "kl_second_iteration_normalized_clipped": {
        "beta": 0.3, "num_iterations": 2, "normalize_advantages": True,
        "reward_clip_range": (-0.6, 0.5)},
}


@pytest.mark.parametrize("name", CASES)
def test_rloo_equals_trls(tmp_path, base, name):
    options = CASES[name]
    model, tok = copy.deepcopy(base[0]), base[1]
    trainer = trl_trainer(tmp_path, model, tok, **options)
    args = trainer.args
    ours = RLOOConfig(**{k: getattr(args, k) for k in RLOOConfig.model_fields
                         if k in ("num_generations", "beta", "epsilon", "epsilon_high",
                                  "num_iterations", "normalize_advantages",
                                  "reward_clip_range", "reward_weights",
                                  "mask_truncated_completions", "temperature")},
                      reward_funcs=["m:reward_len", "m:reward_vowels"])
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(GROUP)]
    out = trainer._generate_and_score_completions(inputs)
    policy = trainer.model
    input_ids, attention, mask = ours_batch(out)
    metrics = trainer._metrics["train"]

    # the log-probabilities at generation (TRL keeps their sum per completion)
    with torch.no_grad():
        old = completion_logps(policy, input_ids, attention, mask.shape[1], TEMPERATURE)[0]
    torch.testing.assert_close((old * mask).sum(-1), out["old_logps"], atol=1e-5, rtol=1e-5)
    kl = None
    if ours.beta:
        with torch.no_grad():
            ref = completion_logps(trainer.ref_model, input_ids, attention, mask.shape[1],
                                   TEMPERATURE)[0]
        kl = ((old - ref) * mask).sum(-1)

    # the rollout: rewards (TRL's calling convention), leave-one-out advantages
    done = Completions(ids=out["completion_ids"], mask=mask, lengths=mask.sum(1),
                       clipped=mask[:, -1].bool())
    funcs = [RewardFunction("reward_len", reward_len), RewardFunction("reward_vowels",
                                                                      reward_vowels)]
    inputs_json = [json.dumps({"prompt": p}) for p in PROMPTS]
    per_func, _, _ = score_completions(tok, funcs, inputs_json, done, GROUP,
                                       key="rloo.reward_funcs")
    advantages, stats = leave_one_out_advantages(
        per_func, torch.tensor(ours.reward_weights), ours.num_generations, kl, ours.beta,
        ours.reward_clip_range, ours.normalize_advantages)
    torch.testing.assert_close(advantages, out["advantages"], atol=1e-5, rtol=0)
    assert advantages.abs().sum() > 0
    for key in ("reward", "reward_std", "frac_reward_zero_std"):
        assert float(stats[key]) == pytest.approx(last(metrics, key), abs=1e-5), key
    for i, fname in enumerate(("reward_len", "reward_vowels")):
        for s in ("mean", "std"):
            assert float(stats[f"rewards/{i}/{s}"]) == pytest.approx(
                last(metrics, f"rewards/{fname}/{s}"), abs=1e-5)
    if ours.beta:  # the run logs it per step: per token over the step's completion tokens
        assert float(kl.sum() / mask.sum()) == pytest.approx(last(metrics, "kl"), abs=1e-5)
    else:
        assert "kl" not in metrics

    theirs, their_grads = trls_loss_and_gradients(trainer, policy, out,
                                                  moved=ours.num_iterations > 1)

    logps, entropy = completion_logps(policy, input_ids, attention, mask.shape[1], TEMPERATURE,
                                      with_entropy=True)
    losses = sequence_losses(logps, old if ours.num_iterations > 1 else None, advantages, mask,
                             ours.epsilon, ours.clip_high)
    mine = losses.per_token.sum() / mask.shape[0]
    mine.backward()
    assert float(mine.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5)
    for a, b in zip((p.grad for p in policy.parameters()), their_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)

    from engine.recipe.rloo.run import RLOORun

    objective = RLOORun.make_objective(type("R", (), {"g": ours})())
    means = {k: float(v) for k, v in stat_means(
        token_stat_sums(losses, entropy, mask, per_sequence=True), objective).items()}
    logged = {k for k in metrics if k == "entropy"
              or k.startswith("clip_ratio/") and k.endswith("_mean")}
    assert set(means) == logged, (set(means), logged)
    for key, value in means.items():
        assert value == pytest.approx(last(metrics, key), abs=1e-5), key
    if ours.num_iterations > 1:  # the moved weights clipped some ratios: not vacuous
        assert means["clip_ratio/region_mean"] > 0
