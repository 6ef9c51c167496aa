"""Our environment rollout (engine.rollout.episodes.Episodes with an environment loaded by
engine.rollout.environment.load_environments, its ToolLoop around LocalGenerator), its scoring
(engine.rollout.scoring.score_completions with engine.recipe.grpo.rollouts.environment_rewards)
and its advantages and logged statistics (engine.recipe.grpo.advantages through GRPORun's
`advantages`) held equal to TRL 1.16's own: GRPOTrainer(environment_factory=Calculator) runs
`_generate_and_score_completions` on the same rows, unpatched (the test only records what
`_generate`, `_tool_call_loop` and `_calculate_rewards` return). Per rollout, in TRL's order:
its prompt's ids (reset's text appended to the last user message, the prompt rendered again
with the environment's methods as its tools), its completion's token ids and tool mask; the
tool calls and failures; the prompts the reward functions see; each reward function's rewards
(a plain one taking `environments=` and a row column, and the environment's own `get_reward`,
named after its class); the advantages (scale_rewards 'group', TRL's default); and the step's
statistics TRL logs that we log too (`reward`, `reward_std`, `frac_reward_zero_std`,
`rewards/<name>/mean|std`, `tools/call_frequency`, `tools/failure_frequency`,
`completions/clipped_ratio`).

The model is tests/test_grpo_tools.py's rigged one-layer Llama writing Qwen's call of add(2, 3)
after the generation prompt (test_grpo_tools_trl's "qwen" form, its response template set as
TRL needs one): each episode is a call, its result, a call, its result and a third call, left
unrun at max_tool_calling_iterations=2. Calculator's `add` keeps a running total and returns it,
so the results the model reads (5, then 10) come from the rollout's own instance.

Every episode is alike, so to make the two rollouts of a prompt score differently (advantages
not all zero) `reset` also hands each rollout a ticket from a class-level counter, zeroed before
each side runs: the tickets follow the order the rollouts are reset in, which is rollout order
on both sides, and the plain reward gives odd tickets 0.5 more.

The loss and gradients on those tool-masked rollouts are TRL's too (`_compute_loss` on its
output against our batch, GRPORun.completion_batch, and our step, GRPORun.micro_step), for each
loss type both have, and so are the token statistics TRL logs from the loss (entropy, clip
ratios): tool results are context, never trained, and every loss type's normaliser counts only
the tokens the model wrote.

`completions/mean_length` is TRL's too: with tools, the tokens the model wrote (the sum of a
completion's tool mask), 6 here of each completion's 43 (3 calls and 3 ends of turn are the
model's; the two results and the generation prompts after them are not). Until this test, ours
counted all 43.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import test_grpo_tools
from test_grpo_tools_trl import MAX_ITERATIONS, MAX_LENGTH, NUM_GENERATIONS, QWEN_CALL

ENVIRONMENT = "test_grpo_environments_trl:Calculator"
#: the dataset: two prompts, each with its own target
ROWS = [{"prompt": [{"role": "user", "content": f"Add up to the target. ({i})"}],
         "target": target} for i, target in enumerate((10, 7))]
#: the statistics both sides log and compute alike
STATS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/reached/mean",
         "rewards/reached/std", "rewards/Calculator/mean", "rewards/Calculator/std",
         "tools/call_frequency", "tools/failure_frequency", "completions/clipped_ratio",
         "completions/mean_length")
INJECTED_ADVANTAGES = torch.tensor([1.0, 0.5, -0.3, 0.8])


class Calculator:
    """A running total the model adds to, towards the row's target (TRL's documented shape)."""

    tickets = itertools.count()  # see the module docstring

    def __init__(self):
        self.total, self.target, self.ticket = 0, None, None

    def reset(self, **row) -> str:
        self.total, self.target, self.ticket = 0, row["target"], next(Calculator.tickets)
        return f" The target is {row['target']}."

    def add(self, a: int, b: int) -> int:
        """Adds two integers to the running total and returns the total.

        Args:
            a: the first
            b: the second
        """
        self.total += a + b
        return self.total

    def get_reward(self) -> float:
        return -abs(self.target - self.total)


def reached(completions, environments, target, **kwargs) -> list[float]:
    """1 where the rollout's total reached its row's target, 0.5 more for an odd ticket."""
    return [float(e.total >= t) + 0.5 * (e.ticket % 2) for e, t in zip(environments, target)]


def trls_rollout(model_dir: Path, tok, out: Path) -> dict:
    """GRPOTrainer(environment_factory=Calculator) on the CPU, in training mode, generating
    and scoring ROWS, each repeated NUM_GENERATIONS times as its RepeatSampler hands them:
    what `_generate`, `_tool_call_loop` and `_calculate_rewards` returned, the arguments the
    rewards were computed from, the output's advantages and the logged metrics."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, use_vllm=False,
                      num_generations=NUM_GENERATIONS, max_completion_length=MAX_LENGTH,
                      max_tool_calling_iterations=MAX_ITERATIONS,
                      per_device_train_batch_size=NUM_GENERATIONS, report_to="none")
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                          reward_funcs=reached, args=args, processing_class=tok,
                          environment_factory=Calculator, train_dataset=Dataset.from_list(ROWS))
    seen: dict = {}

    def recording(name):
        method = getattr(trainer, name)

        def record(*a, **k):
            seen[name] = method(*a, **k)
            if name == "_calculate_rewards":
                seen["reward_prompts"] = a[1]
            return seen[name]
        return record

    for name in ("_generate", "_tool_call_loop", "_calculate_rewards"):
        setattr(trainer, name, recording(name))
    trainer.model.train()
    Calculator.tickets = itertools.count()
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(
        [dict(row) for row in ROWS for _ in range(NUM_GENERATIONS)])
    prompt_ids, completion_ids, tool_mask = seen["_generate"][:3]
    calls, failures = seen["_tool_call_loop"][4:6]
    return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completion_ids,
            "tool_mask": tool_mask, "calls": calls, "failures": failures,
            "reward_prompts": seen["reward_prompts"], "rewards": seen["_calculate_rewards"],
            "names": list(trainer.reward_func_names), "weights": trainer.reward_weights,
            "scale_rewards": args.scale_rewards, "advantages": output["advantages"],
            "metrics": {k: v[-1] for k, v in trainer._metrics["train"].items()},
            "trainer": trainer, "output": output}


def our_rollout(model_dir: Path, tok, scale_rewards: str) -> dict:
    """Episodes over a ToolLoop(LocalGenerator) with the environment load_environments loads,
    the prompts rendered as test_grpo_tools_trl.our_rollout encodes them; scored with the plain
    reward and the environment's; the advantages and statistics as GRPORun computes them."""
    from transformers import AutoModelForCausalLM

    from engine.recipe.grpo.rollouts import environment_rewards, reward_weights
    from engine.recipe.grpo.run import GRPORun, completion_columns
    from engine.rollout.environment import load_environments
    from engine.rollout.episodes import Episodes
    from engine.rollout.generator import left_pad
    from engine.rollout.local import LocalGenerator, eos_ids
    from engine.rollout.multi_turn import ToolLoop
    from engine.rollout.rewards import RewardFunction
    from engine.rollout.sampling import SamplingParams
    from engine.rollout.scoring import score_completions

    def render(prompt: list[dict], schemas: list[dict]) -> list[int]:
        text = tok.apply_chat_template(prompt, tools=schemas, tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    environments = load_environments(ENVIRONMENT, "grpo.environment_factory")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = LocalGenerator(model, SamplingParams(max_completion_length=MAX_LENGTH),
                               eos_ids(tok, model), tok.pad_token_id)
    loop = ToolLoop(generator, tok, MAX_ITERATIONS, MAX_LENGTH,
                    model.config.max_position_embeddings)
    episodes = Episodes(generator, loop, environments, {}, None, render)
    ids, mask = left_pad([render(r["prompt"], environments.schemas[None]) for r in ROWS],
                         tok.pad_token_id)
    inputs = [json.dumps(r) for r in ROWS]
    Calculator.tickets = itertools.count()
    rolled = episodes.generate(ids, mask, inputs, NUM_GENERATIONS, [11, 12])

    funcs = [RewardFunction("reached", reached), *environment_rewards(environments)]
    rewards, prompts, _ = score_completions(
        tok, funcs, inputs, rolled.done, NUM_GENERATIONS, key="grpo.reward_funcs",
        prompts=rolled.prompts, environments=rolled.environments)
    from finetune.config.grpo import GRPOConfig

    # the config's defaults for the rest (model_construct: "reached" is this test's function)
    cfg = SimpleNamespace(grpo=GRPOConfig.model_construct(
        reward_funcs=["reached"], reward_weights=None, num_generations=NUM_GENERATIONS,
        scale_rewards=scale_rewards), training=SimpleNamespace(type="grpo"))
    run = GRPORun.__new__(GRPORun)  # the run's methods on just what they read
    vars(run).update(cfg=cfg, rewards=funcs,
                     dist=SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0),
                     weights=torch.tensor(reward_weights(cfg, len(funcs))))
    done = rolled.done  # the completions' columns as GRPORun.rollout stacks them
    advantages, stats = run.advantages(rewards, completion_columns(done), [])
    named = dict(zip(("reward", "reward_std", "frac_reward_zero_std"),
                     GRPORun.reward_stats(run, stats)))
    for i, f in enumerate(funcs):
        named[f"rewards/{f.name}/mean"] = stats[f"rewards/{i}/mean"]
        named[f"rewards/{f.name}/std"] = stats[f"rewards/{i}/std"]
    for name in ("tools/call_frequency", "tools/failure_frequency",
                 "completions/clipped_ratio", "completions/mean_length"):
        named[name] = stats[name]
    prompt_ids = [[t for t, m in zip(row, keep) if m] for row, keep in
                  zip(rolled.prompt_ids.tolist(), rolled.prompt_mask.tolist())]
    # the training rows as GRPORun.rollout builds them: each rollout's own prompt, its episode
    run.cfg.grpo.mask_truncated_completions = False
    batch = GRPORun.completion_batch(
        run, *rolled.forward_prompts(ids, mask, NUM_GENERATIONS), done)
    batch["advantages"] = advantages
    return {"prompt_ids": prompt_ids, "done": done, "prompts": prompts, "rewards": rewards,
            "names": [f.name for f in funcs], "weights": run.weights, "advantages": advantages,
            "metrics": {k: float(v) for k, v in named.items()}, "model": model, "batch": batch}


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[dict, dict, object]:
    from trl.chat_template_utils import qwen3_template

    tmp = tmp_path_factory.mktemp("environments_trl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
        patch.setattr(test_grpo_tools, "CALL", QWEN_CALL)  # rigged_model reads it when called
        tok = test_grpo_tools.rigged_model(tmp / "model")
        tok.response_template = qwen3_template
        trl = trls_rollout(tmp / "model", tok, tmp / "trl")
        ours = our_rollout(tmp / "model", tok, trl["scale_rewards"])
    return trl, ours, tok


def test_environment_rollouts_scores_and_advantages_are_trls(both):
    trl, ours, tok = both
    rows = len(ROWS) * NUM_GENERATIONS
    done = ours["done"]

    # each rollout's prompt: the observation appended and the environment's tools rendered
    assert ours["prompt_ids"] == trl["prompt_ids"], [tok.decode(p) for p in trl["prompt_ids"]]
    for i in range(rows):
        text = tok.decode(ours["prompt_ids"][i])
        assert f"The target is {ROWS[i // NUM_GENERATIONS]['target']}." in text and (
            "running total" in text), text
    assert ours["prompts"] == trl["reward_prompts"]

    # the episodes, token for token, and their tool masks and calls
    for i in range(rows):
        n = int(done.lengths[i])
        theirs = trl["completion_ids"][i]
        assert done.ids[i, :n].tolist() == theirs, (i, tok.decode(done.ids[i, :n]),
                                                    tok.decode(theirs))
        assert done.trained[i, :n].tolist() == trl["tool_mask"][i], i
        results = tok.decode(theirs)
        assert "<tool_response>\n5\n</tool_response>" in results and (
            "<tool_response>\n10\n</tool_response>" in results), results  # the instance's state
    assert int(done.tool_calls.sum()) == trl["calls"] == rows * MAX_ITERATIONS
    assert int(done.tool_failures.sum()) == trl["failures"] == 0

    # the rewards: the plain function's and the environment's own, named after its class
    assert ours["names"] == trl["names"] == ["reached", "Calculator"]
    assert ours["weights"].tolist() == trl["weights"].tolist() == [1.0, 1.0]
    assert ours["rewards"].tolist() == trl["rewards"].tolist() == [
        [1.0, 0.0], [1.5, 0.0], [1.0, -3.0], [1.5, -3.0]]

    # the advantages (not all zero: the tickets) and the logged statistics
    assert trl["scale_rewards"] == "group"
    torch.testing.assert_close(ours["advantages"], trl["advantages"], rtol=0, atol=1e-5)
    assert ours["advantages"].abs().min() > 0.5
    for name in STATS:
        assert ours["metrics"][name] == pytest.approx(trl["metrics"][name], abs=1e-5), name


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_the_loss_and_gradients_on_tool_masked_rollouts_are_trls(both, loss_type):
    """TRL's `_compute_loss` on its rollouts (completion_mask * tool_mask) against our
    GRPORun.micro_step on ours, for one optimizer step of the whole batch: the loss, every
    parameter's gradient, and the token statistics TRL logs from the loss. Most of each
    completion is a tool's result (37 of 43 tokens): a loss or normaliser that counted them
    would differ by far more than the tolerance."""
    from engine.recipe.grpo.loss import STAT_SLOTS, Objective, averaged_over, stat_means
    from engine.recipe.grpo.run import GRPORun

    trl, ours, _ = both
    trainer, output = trl["trainer"], trl["output"]
    trainer.loss_type = loss_type
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, not run here
    # a group's rollouts are token for token alike here and its advantages sum to 0, so their
    # gradients cancel exactly: both sides take the same injected advantages instead (the
    # rollout's own are TRL's, tested above)
    output = {**output, "advantages": INJECTED_ADVANTAGES}
    trainer._metrics["train"].clear()
    policy = trainer.model
    # the rigged model's logits (40 apart) make its tokens certain in float32 and its gradients
    # exactly 0: both sides' LM heads are scaled down alike after the rollouts (the loss is
    # taken on weights moved since generation, as an update would move them)
    with torch.no_grad():
        for m in (policy, ours["model"]):
            if m.lm_head.weight.abs().max() > 10:
                m.lm_head.weight.mul_(0.1)
    policy.zero_grad(set_to_none=True)
    theirs = trainer._compute_loss(policy, output)
    theirs.backward()
    their_grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    batch, model = {**ours["batch"], "advantages": INJECTED_ADVANTAGES}, ours["model"]
    written = torch.tensor(trl["tool_mask"]).sum()  # the tokens the model wrote, all rollouts
    assert int(batch["completion_mask"].sum()) == int(written) < int(
        output["completion_mask"].sum()) / 3
    from finetune.config.grpo import GRPOConfig

    grpo = GRPOConfig.model_construct(  # the config's defaults for the rest
        epsilon=0.2, epsilon_high=trainer.epsilon_high, beta=0.0, use_bias_correction_kl=False,
        loss_type=loss_type, max_completion_length=MAX_LENGTH, temperature=1.0)
    assert (trainer.epsilon_low, trainer.beta, trainer.temperature) == (0.2, 0.0, 1.0)
    run = GRPORun.__new__(GRPORun)  # the run's methods on just what they read
    vars(run).update(
        cfg=SimpleNamespace(grpo=grpo, training=SimpleNamespace(
            type="grpo", enable_activation_offloading=False)),
        dist=SimpleNamespace(device=torch.device("cpu")), model=model.train(), amp=None,
        scaler=None, prompt_group=1, objective=Objective.of(grpo),
        token_sums=torch.zeros(STAT_SLOTS, dtype=torch.float64))
    model.zero_grad(set_to_none=True)
    divisor = averaged_over(loss_type, batch["completion_mask"])  # one micro-batch per step
    loss_sum = GRPORun.micro_step(run, batch["labels"], batch, divisor)
    assert float(loss_sum / divisor) == pytest.approx(float(theirs.detach()), abs=1e-5)
    for name, p in model.named_parameters():
        # the largest gradient entries are 3e-5 (dr_grpo) to 3e-4 here, so 1e-6 (seen: 1.2e-7)
        torch.testing.assert_close(p.grad, their_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert max(g.abs().max() for g in their_grads.values()) > 1e-5  # not vacuously equal
    means = stat_means(run.token_sums, run.objective)
    for name, value in means.items():
        assert float(value) == pytest.approx(metrics[name], abs=1e-5), name
    assert "entropy" in means and "clip_ratio/region_mean" in means
