"""GRPO against TRL's GRPOTrainer as the oracle: the same model, prompts and completions
(injected into TRL's generation, so sampling is out of the comparison) give the same
advantages, log-probabilities at generation, reference log-probabilities, loss, gradients and
logged statistics (kl, entropy, clip ratios, reward statistics), for every loss_type, beta 0
and > 0, num_iterations 1 and 2 (the second iteration after the weights moved, so the ratio
and its clipping are not trivially 1); and the rest of the family (GSPO's sequence-level
ratio, two-sided clipping, CISPO, SAPO, LUSPO, the off-policy sequence mask, GDPO's
normalize_then_sum advantages, VESPO, the top-entropy token mask)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.recipe.grpo.advantages import group_advantages
from engine.recipe.grpo.loss import Objective, completion_logps, entropy_token_mask, reduce, \
    stat_means, token_losses, token_stat_sums
from engine.rollout.generator import Completions
from engine.rollout.rewards import RewardFunction
from engine.rollout.scoring import score_completions

trl = pytest.importorskip("trl")

MODEL = Path(__file__).resolve().parents[1] / "data" / "models" / "stories260K"
PROMPTS = ["Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:",
           "Question: Once upon a time\nAnswer:"]
GROUP, LENGTH, TEMPERATURE = 4, 10, 0.7


def reward_len(completions, **kwargs):
    """TRL's documentation example: prefer completions near 20 characters."""
    return [-abs(20 - len(completion)) / 20 for completion in completions]


def reward_vowels(completions, **kwargs):
    return [sum(c in "aeiou" for c in completion) / 10 for completion in completions]


def injected_completions(tok) -> list[list[int]]:
    """Fixed completions: random tokens, some ended by EOS early, some clipped at LENGTH."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(len(PROMPTS) * GROUP):
        n = LENGTH if i % 3 == 0 else 3 + i % 6
        ids = torch.randint(3, tok.vocab_size, (n,), generator=g).tolist()
        if n < LENGTH:
            ids[-1] = tok.eos_token_id
        rows.append(ids)
    return rows


class Injected(trl.GRPOTrainer):
    """TRL's trainer with its sampling replaced by fixed completions."""

    injected: list[list[int]] = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        assert len(prompt_ids) == len(self.injected)
        return [list(ids) for ids in self.injected], None


def trl_trainer(tmp_path, model, tok, loss_type: str, beta: float, iterations: int,
                **options):
    import datasets

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PROMPTS) * GROUP,
        num_generations=GROUP, max_completion_length=LENGTH, temperature=TEMPERATURE,
        beta=beta, loss_type=loss_type, num_iterations=iterations, epsilon=0.2,
        **{"epsilon_high": 0.28, **options}, scale_rewards="group",
        gradient_accumulation_steps=1,
        reward_weights=[1.0, 0.5], report_to=[], use_cpu=True, max_steps=1, logging_steps=1,
        bf16=False, fp16=False, save_strategy="no")
    data = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = Injected(model=model, reward_funcs=[reward_len, reward_vowels], args=args,
                       train_dataset=data, processing_class=tok)
    trainer.injected = injected_completions(tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, not run here
    return trainer


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    return model, tok


def ours_batch(out: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    return input_ids, attention, out["completion_mask"]


def last(metrics: dict, name: str) -> float:
    return metrics[name][-1]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("beta,iterations", [(0.0, 1), (0.04, 1), (0.0, 2), (0.04, 2)])
@pytest.mark.parametrize("group", [1, GROUP])
def test_loss_gradients_and_statistics_equal_trls(tmp_path, base, loss_type, beta, iterations,
                                                  group):
    """group GROUP: our log-probabilities with each prompt's forward shared by its
    completions (completion_logps `group`, what a single-process run uses)."""
    means = compare_with_trl(tmp_path, base, loss_type, beta, iterations, group)
    if iterations > 1:  # the perturbation clipped some ratios: the statistic is not vacuous
        assert means["clip_ratio/region_mean"] > 0


#: the rest of the family: TRL's options, and ours
FAMILY = {
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "two_sided": {"loss_type": "dapo", "delta": 1.002},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.0},
    "sapo": {"loss_type": "sapo", "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.3},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "luspo_token": {"loss_type": "luspo"},
    "off_policy_mask": {"loss_type": "dapo", "off_policy_mask_threshold": 0.0},
    "normalize_then_sum": {"loss_type": "dapo",
                           "multi_objective_aggregation": "normalize_then_sum"},
    "vespo": {"loss_type": "vespo", "vespo_k_neg": 2.5, "vespo_lambda_pos": 2.0},
    "top_entropy_quantile": {"loss_type": "dapo", "top_entropy_quantile": 0.3},
}


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("beta,iterations", [(0.0, 1), (0.04, 2)])
def test_the_rest_of_the_family_equals_trls(tmp_path, base, name, beta, iterations):
    """Each loss type and estimator TRL 1.16 has besides the four, with its names: loss,
    gradients and logged statistics (cispo_clip_ratio for cispo, no clip ratios for sapo;
    a sequence-level ratio's clip ratios are means over completions)."""
    options = dict(FAMILY[name])
    loss_type = options.pop("loss_type")
    means = compare_with_trl(tmp_path, base, loss_type, beta, iterations, 1, **options)
    if iterations > 1 and loss_type == "cispo":
        assert means["cispo_clip_ratio"] > 0


def trls_loss_and_gradients(trainer, policy, out: dict, moved: bool):
    """TRL's loss on `out` and its gradients (the policy's gradients left cleared); `moved`:
    first the weights move as they would between generation and a second iteration."""
    if moved:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.003)
    theirs = trainer._compute_loss(policy, out)
    theirs.backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad(set_to_none=True)
    return theirs, grads


def compare_with_trl(tmp_path, base, loss_type: str, beta: float, iterations: int, group: int,
                     **options) -> dict[str, float]:
    """Our rollout statistics, loss, gradients and logged statistics against TRL's on the
    injected completions; returns our logged means. Our objective is read off TRL's
    GRPOConfig through our config's names (Objective.of), so a name of ours that is not
    TRL's fails here."""
    model, tok = copy.deepcopy(base[0]), base[1]
    trainer = trl_trainer(tmp_path, model, tok, loss_type, beta, iterations, **options)
    args = trainer.args
    objective = Objective.of(SimpleNamespace(**vars(args), clip_high=args.epsilon_high))
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(GROUP)]
    out = trainer._generate_and_score_completions(inputs)
    policy = trainer.model
    input_ids, attention, mask = ours_batch(out)

    # the rollout: rewards (TRL's calling convention), group advantages
    done = Completions(ids=out["completion_ids"], mask=mask, lengths=mask.sum(1),
                       clipped=mask[:, -1].bool())
    funcs = [RewardFunction("reward_len", reward_len), RewardFunction("reward_vowels",
                                                                      reward_vowels)]
    inputs_json = [json.dumps({"prompt": p}) for p in PROMPTS]
    per_func, _, _ = score_completions(tok, funcs, inputs_json, done, GROUP,
                                       key="grpo.reward_funcs")
    advantages, stats = group_advantages(per_func, torch.tensor([1.0, 0.5]), GROUP, "group",
                                         options.get("multi_objective_aggregation",
                                                     "sum_then_normalize"))
    torch.testing.assert_close(advantages, out["advantages"], atol=1e-5, rtol=0)
    metrics = trainer._metrics["train"]
    assert float(stats["reward"]) == pytest.approx(last(metrics, "reward"), abs=1e-5)
    assert float(stats["reward_std"]) == pytest.approx(last(metrics, "reward_std"), abs=1e-5)
    for i, name in enumerate(("reward_len", "reward_vowels")):
        assert float(stats[f"rewards/{i}/mean"]) == pytest.approx(
            last(metrics, f"rewards/{name}/mean"), abs=1e-5)
        assert float(stats[f"rewards/{i}/std"]) == pytest.approx(
            last(metrics, f"rewards/{name}/std"), abs=1e-5)

    # the log-probabilities taken before any update
    with torch.no_grad():
        old = completion_logps(policy, input_ids, attention, mask.shape[1], TEMPERATURE,
                               group=group)[0]
    if iterations > 1:
        torch.testing.assert_close(old * mask, out["old_per_token_logps"] * mask, atol=1e-5,
                                   rtol=1e-5)
    else:
        assert "old_per_token_logps" not in out
        old = None
    ref = None
    if beta:
        with torch.no_grad():
            ref = completion_logps(trainer.ref_model, input_ids, attention, mask.shape[1],
                                   TEMPERATURE, group=group)[0]
        # log-probabilities near -14: float noise of TRL's tiled LM head is ~1e-6 relative
        torch.testing.assert_close(ref * mask, out["ref_per_token_logps"] * mask, atol=1e-5,
                                   rtol=1e-5)
    theirs, their_grads = trls_loss_and_gradients(trainer, policy, out, moved=iterations > 1)

    logps, entropy = completion_logps(policy, input_ids, attention, mask.shape[1], TEMPERATURE,
                                      with_entropy=True, group=group)
    losses = token_losses(logps, old, ref, advantages, mask, objective,
                          entropy_token_mask(entropy, mask, objective))
    loss_sum, count = reduce(loss_type, losses.per_token, mask, LENGTH)
    ours = loss_sum / count
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5)
    for mine, their in zip((p.grad for p in policy.parameters()), their_grads):
        # float noise of TRL's tiled LM head: a few of 2048 entries differ by ~1.5e-5
        torch.testing.assert_close(mine, their, atol=5e-5, rtol=1e-4)

    sums = token_stat_sums(losses, entropy, mask, objective.level == "sequence")
    means = {k: float(v) for k, v in stat_means(sums, objective).items()}
    # the names TRL logs from _compute_loss (less its min/max over completions)
    theirs_logged = {k for k in metrics if k in ("kl", "entropy", "cispo_clip_ratio",
                                                 "vespo/phi_seq_mean")
                     or k.endswith("_mean") and k.startswith("clip_ratio/")}
    assert set(means) == theirs_logged, (set(means), theirs_logged)
    for name, value in means.items():
        assert value == pytest.approx(last(metrics, name), abs=1e-5), name
    return means

