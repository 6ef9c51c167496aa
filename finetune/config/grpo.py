"""The `grpo` section: online RL with reward functions (`training.type: grpo`), with TRL's
GRPOConfig names and meanings. engine/recipe/grpo/ is its room: the group advantages, the
clipped loss, the run and its held-out metrics; the generator and the reward functions it uses
are the rollout's (engine/rollout/), which any method that generates can use.

One difference in meaning, said where it matters: `training.per_device_train_batch_size` counts
*prompts* here (each gives `num_generations` completions to the micro-batch), where TRL counts
completions: TRL's batch 8 with num_generations 8 is our batch 1.

Like the dpo section, this module declares its method's facts (it trains on prompt-only rows)
and its rows of the compatibility table.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from finetune.config import compat
from finetune.config.methods import Method, register_method
from finetune.config.model_refs import REGISTERED_MODEL
from finetune.config.reward_refs import BUILT_IN_REWARDS, reward_kind, reward_name
from finetune.config.section import Field, Section


def reported_metrics(cfg) -> tuple[str, ...]:
    """The evaluate stage's GRPO metrics (engine.recipe.grpo.heldout): the weighted reward,
    one per function (named as the metrics are: a built-in's name, a function's own), and
    with the correctness reward its pass rates."""
    g = cfg.grpo
    names = [reward_name(ref) for ref in g.reward_funcs]
    passes = ("pass_at_1", f"pass_at_{g.num_generations_eval}") if "correctness" in names else ()
    rewards = ("reward", *(f"reward_{n}" for n in names))
    return (*rewards, *(f"sampled_{r}" for r in rewards), *passes)


register_method(Method("grpo", accepts=("none",), data_hint=(
    "trains on prompt-only rows (completions are generated during training); set "
    "data.dataset_type: prompt"), metrics=reported_metrics,
    metric_pattern=r"(sampled_)?reward(_\w+)?|pass_at_\d+",
    stderr=lambda cfg, metric: False,  # rewards of sampled completions: no bootstrap here
    prompt_tools=lambda cfg: cfg.grpo.tools,
    prompt_environments=lambda cfg: cfg.grpo.environment_factory,
    default_gate="eval.reward"))


class GRPOConfig(Section):
    """Group relative policy optimisation: sample a group of completions per prompt, score
    them with reward functions, and push up the ones above their group's mean."""

    num_generations: int = Field(
        8, ge=2, fingerprint=True,
        description="Completions sampled per prompt (a group); advantages are normalised "
        "within it, so it needs at least 2.")
    max_completion_length: int = Field(
        256, ge=1, fingerprint=True,
        description="Most tokens generated per completion; one that reaches it without EOS "
        "is clipped (completions/clipped_ratio).")
    temperature: float = Field(
        1.0, gt=0, fingerprint=True,
        description="Sampling temperature; the log-probabilities the loss compares are of the "
        "same tempered distribution (TRL's convention).")
    top_p: float = Field(1.0, gt=0, le=1, fingerprint=True,
                         description="Nucleus sampling: keep the smallest set of tokens whose "
                         "probability reaches top_p (1: off).")
    top_k: int = Field(0, ge=0, fingerprint=True,
                       description="Keep the k most likely tokens (0: off).")
    repetition_penalty: float = Field(
        1.0, gt=0, fingerprint=True,
        description="Penalise tokens already in the prompt or the completion (>1 "
        "discourages repeats; 1: off).")
    reward_funcs: list[str] = Field(
        ["correctness"], fingerprint=True, model_ref="reward_model",
        description="Reward functions (empty only beside an environment_factory whose "
        "class owns its reward, get_reward, as TRL allows): built-ins by name (correctness: "
        "the final answer equals the reference column's, as the evaluate stage checks it; format: the "
        "completion matches format_regex; length: a soft penalty for long completions), "
        "'module:function' / 'path/to/file.py:function' called as TRL calls one: "
        "f(prompts, completions, **columns) -> list of float or None, or a trained reward "
        "model (a one-output sequence classifier with its tokenizer): a directory path with "
        "a '/' (./rm, data/export) or a registered model, models:/name@alias or "
        "models:/name/version.")
    reward_weights: list[float] | None = Field(
        None, fingerprint=True,
        description="One weight per reward function (null: all 1); the reward is the "
        "weighted sum.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", fingerprint=True,
        description="Divide advantages by the reward std of the group, of the whole batch, "
        "or not at all (Dr. GRPO's advice).")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", fingerprint=True,
        description="How several reward functions become one advantage (TRL's name): "
        "sum_then_normalize (the weighted sum, normalised as scale_rewards says), or "
        "normalize_then_sum (GDPO: each function normalised within its group, the weighted "
        "sum then over the batch; a function with a wide range does not drown the others).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo",
                       "vespo"] = Field(
        "dapo", fingerprint=True,
        description="The surrogate and how token losses are averaged (TRL's names): grpo "
        "(per completion, then over completions), bnpo (over the micro-batch's tokens), "
        "dr_grpo (sum over a fixed num completions x max_completion_length), dapo (over the "
        "step's tokens, all ranks; TRL's default); cispo (the ratio, capped at epsilon_high, "
        "weights log pi, as dapo averages; ScaleRL recommends epsilon_high 5.0), sapo (a "
        "sigmoid soft clip instead of the hard one, sapo_temperature_pos/_neg, averaged as "
        "grpo), luspo (grpo's surrogate summed over each completion's tokens, averaged over "
        "completions; with importance_sampling_level sequence, as its paper), vespo (a gamma "
        "weight of the completion's ratio, vespo_k_*/vespo_lambda_*, times log pi, as dapo "
        "averages).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", fingerprint=True,
        description="The probability ratio per token, or per completion (GSPO: the exp of "
        "the mean token log-ratio; with loss_type grpo, sapo or luspo, whose averages keep "
        "it a per-completion objective).")
    delta: float | None = Field(
        None, gt=1, fingerprint=True,
        description="Two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta "
        "too, so a negative advantage cannot push a large ratio further (null: off; must be "
        "above 1 + epsilon_high).")
    sapo_temperature_pos: float = Field(
        1.0, gt=0, fingerprint=True,
        description="loss_type sapo: the soft clip's temperature for positive advantages.")
    sapo_temperature_neg: float = Field(
        1.05, gt=0, fingerprint=True,
        description="loss_type sapo: the soft clip's temperature for the others.")
    vespo_k_pos: float = Field(2.0, fingerprint=True,
                               description="loss_type vespo: k for non-negative advantages.")
    vespo_lambda_pos: float = Field(
        3.0, fingerprint=True, description="loss_type vespo: lambda for non-negative advantages.")
    vespo_k_neg: float = Field(3.0, fingerprint=True,
                               description="loss_type vespo: k for negative advantages.")
    vespo_lambda_neg: float = Field(
        2.0, fingerprint=True, description="loss_type vespo: lambda for negative advantages.")
    top_entropy_quantile: float = Field(
        1.0, gt=0, le=1, fingerprint=True,
        description="Beyond the 80/20 rule: only the completion tokens in this top share by "
        "entropy (over the micro-batch's tokens on all ranks, TRL's quantile) train the "
        "policy term (1: all; the paper's 0.2). The quantile is per micro-batch, as TRL's: "
        "accumulation is not one batch with it.")
    off_policy_mask_threshold: float | None = Field(
        None, ge=0, fingerprint=True,
        description="DeepSeek-V3.2's off-policy sequence mask: a completion with a negative "
        "advantage whose mean log(pi_old / pi) over its tokens exceeds this leaves the loss "
        "(null: off; e.g. 0.5). Needs num_iterations > 1: with 1 the policy is the sampler "
        "and nothing would be masked.")
    beta: float = Field(
        0.0, ge=0, fingerprint=True,
        description="Weight of the KL term to the reference (the base: the adapter disabled "
        "under PEFT, a frozen copy otherwise); 0 loads no reference.")
    use_bias_correction_kl: bool = Field(
        True, fingerprint=True,
        description="Weight the KL term by the probability ratio, so its gradient is the "
        "unbiased reverse-KL gradient (TRL's default; DeepSeek-V3.2).")
    epsilon: float = Field(0.2, gt=0, lt=1, fingerprint=True,
                           description="Lower clipping bound of the probability ratio: "
                           "1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0, fingerprint=True,
        description="Upper clipping bound: 1 + epsilon_high (null: epsilon; DAPO's "
        "clip-higher uses 0.28).")
    num_iterations: int = Field(
        1, ge=1, fingerprint=True,
        description="Optimizer steps per generated batch (PPO epochs): the completions are "
        "generated once and trained on this many times, the ratio measured against the "
        "log-probabilities at generation.")
    mask_truncated_completions: bool = Field(
        False, fingerprint=True,
        description="Leave completions that hit max_completion_length without EOS out of "
        "the loss (DAPO).")
    reference_column: str = Field(
        "answer", fingerprint=True,
        description="The row column the correctness reward compares against (GSM8K's "
        "answer); the answer is found with eval.answer_regex.")
    format_regex: str = Field(
        r"####\s*-?[\d,]*\.?\d+", fingerprint=True,
        description="The format reward: 1 when the completion matches this regex, else 0.")
    tools: list[str] = Field(
        [], fingerprint=True, code_ref=True,
        description="Tools the model may call during a rollout (TRL's GRPOTrainer tools=): "
        "'module:function' or 'path/to/file.py:function', each with a type hint on every "
        "argument and a Google-style docstring (transformers' get_json_schema makes the "
        "schema the format stage renders into the prompts). A completion's calls run, their "
        "results are appended as tool messages (not trained on) and the model continues, "
        "until a turn calls none, max_tool_calling_iterations, or max_completion_length "
        "tokens for the whole episode.")
    environment_factory: str | dict[str, str] | None = Field(
        None, fingerprint=True, code_ref=True,
        description="An environment each rollout acts in (TRL's GRPOTrainer "
        "environment_factory=): 'module:Class' (or 'path/to/file.py:Class'), or a mapping "
        "{name: 'module:Class'} with a per-row 'environment' column choosing one. One instance "
        "per rollout; reset(**row) before it, returning None or text appended to the prompt's "
        "last user message; its public methods are the model's tools (beside grpo.tools); an "
        "optional get_reward() scores the rollout (a reward named after the class, weight 1). "
        "Reward functions receive the instances as environments=.")
    max_tool_calling_iterations: int | None = Field(
        None, ge=1, fingerprint=True,
        description="Most rounds of tool calls per completion (TRL's name; null: until a turn "
        "calls no tool or the episode reaches max_completion_length).")
    tool_timeout: float | None = Field(
        None, gt=0, fingerprint=True,
        description="Seconds a tool call may run; one still running is answered with TRL's "
        "error text and counted as a failure (null: no limit).")
    tool_sandbox: Literal["none", "subprocess"] = Field(
        "none", fingerprint=True,
        description="Where a tool call runs: none (in the training process, on a helper "
        "thread), or subprocess (a child with CPU-time and memory limits, killed at "
        "tool_timeout: for tools that run model-written code).")
    num_generations_eval: int = Field(
        4, ge=1, fingerprint=False,
        description="The evaluate stage's k: pass@k over k completions sampled per held-out "
        "prompt at `temperature` (greedy pass@1 is reported too).")

    @field_validator("reward_funcs")
    @classmethod
    def _named(cls, refs: list[str]) -> list[str]:
        for i, ref in enumerate(refs):
            kind = reward_kind(ref)
            if kind == "built_in" and ref not in BUILT_IN_REWARDS:
                raise ValueError(f"reward_funcs[{i}] '{ref}' is neither a built-in ("
                                 f"{', '.join(BUILT_IN_REWARDS)}), 'module:function' nor a "
                                 "reward model directory (a path with a '/', e.g. ./rm)")
            if kind == "registered" and not REGISTERED_MODEL.fullmatch(ref):
                raise ValueError(f"reward_funcs[{i}] '{ref}' is not a registered model's URI: "
                                 "models:/name@alias or models:/name/version")
        return refs

    @model_validator(mode="after")
    def _compat(self) -> "GRPOConfig":
        compat.check(self, "grpo")
        return self

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


GRPO = compat.When("training.type grpo", lambda c: c.training.type == "grpo")
#: what a multi-turn rollout (tools, environments) cannot run under yet, and why
SHARDED = compat.When(
    "sharded weights (distributed.strategy fsdp2, or diloco with fsdp_group_size > 1)",
    lambda c: c.distributed.strategy == "fsdp2" or (
        c.distributed.strategy == "diloco" and c.distributed.diloco is not None
        and c.distributed.diloco.fsdp_group_size > 1))
SHARDED_WHY = ("every generation forward gathers the shards, so every rank must run as many "
               "turns as the rank that calls tools longest, which the tool loop does not do "
               "yet; use distributed.strategy ddp or single")


def _environment_rows() -> list:
    """What an environment rollout cannot run with (grpo.environment_factory), as for tools:
    its methods are tools rendered into a conversational prompt, and they change the
    instance's state, which a call run in a child process would lose."""
    used = lambda c: c.training.type == "grpo" and bool(c.grpo.environment_factory)  # noqa: E731
    base = {"training.type": "grpo", "data.dataset_type": "prompt",
            "registry.gate_metric": "eval.reward", "grpo.environment_factory": "m:Env",
            "data.prompt_template": None}
    return [
        compat.Refuse("config", "data.tools", compat.When(
            "grpo.environment_factory", used),
            "the prompts offer the environment's methods (their schemas, as TRL renders "
            "them); tools the rollout cannot run would be offered otherwise: set one",
            example={**base, "data.tools": [
                {"name": "f", "parameters": {"type": "object", "properties": {}}}]}),
        compat.Refuse("config", "grpo.environment_factory", SHARDED, SHARDED_WHY, used=used,
            example={**base, "distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2}),
        compat.Refuse("config", "grpo.environment_factory", compat.When(
            "data.prompt_template or data.prompt_func (a string prompt)",
            lambda c: c.data.prompt_template is not None or bool(c.data.prompt_func)),
            "reset's text is appended to the prompt's last user message and the chat template "
            "renders the environment's tools, so the rows need a conversational 'prompt' "
            "column", used=used, example={**base, "data.prompt_template": "Q: {question}"}),
        compat.Refuse("config", "grpo.environment_factory", compat.When(
            "grpo.tool_sandbox subprocess", lambda c: c.grpo.tool_sandbox == "subprocess"),
            "an environment's methods change its state, which a call run in a child process "
            "would lose; run its calls in the worker (tool_sandbox: none) and give code-running "
            "tools their own limits", used=used,
            example={**base, "grpo.tool_sandbox": "subprocess"}),
    ]


def _one_weight_per_function(g: GRPOConfig) -> str | None:
    if g.reward_weights is None or len(g.reward_weights) == len(g.reward_funcs):
        return None
    return (f"reward_weights has {len(g.reward_weights)} weights for {len(g.reward_funcs)} "
            "reward_funcs; give one per function or null")


def _delta_above_the_clip(g: GRPOConfig) -> str | None:
    if g.delta is None or g.delta > 1 + g.clip_high:
        return None
    return (f"delta {g.delta} is not above 1 + epsilon_high ({1 + g.clip_high:g}): the cap "
            "would cut positive advantages below the clipped ratio; set it above, or null")


def _a_reward_source(g: GRPOConfig) -> str | None:
    if g.reward_funcs or g.environment_factory:
        return None
    return ("reward_funcs is empty and there is no environment_factory: name a reward "
            "function (e.g. [correctness]) or an environment whose class scores its rollouts "
            "(get_reward)")


#: grpo's rows of the compatibility table (finetune/config/compat.py)
ROWS: list[compat.Rule] = [
    compat.Refuse("grpo", "importance_sampling_level", compat.When(
        "loss_type bnpo, dr_grpo, dapo or cispo",
        lambda g: g.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo")),
        "these sum token losses, which weights each completion's one ratio by its length "
        "instead of optimizing the per-completion objective (GSPO); use loss_type grpo, "
        "sapo or luspo", used=lambda g: g.importance_sampling_level == "sequence",
        example={"grpo.importance_sampling_level": "sequence", "grpo.loss_type": "dapo"}),
    compat.Refuse("grpo", "importance_sampling_level", compat.When(
        "loss_type vespo", lambda g: g.loss_type == "vespo"),
        "vespo weighs each completion by its own sequence-level ratio, from the token ratios",
        used=lambda g: g.importance_sampling_level == "sequence",
        example={"grpo.importance_sampling_level": "sequence", "grpo.loss_type": "vespo"}),
    compat.Refuse("grpo", "loss_type", compat.When(
        "epsilon_high null", lambda g: g.epsilon_high is None),
        "cispo caps the ratio weighting log pi at epsilon_high itself (ScaleRL: 5.0); left "
        "null it would be epsilon (0.2), below 1, so every ratio would be capped",
        used=lambda g: g.loss_type == "cispo", example={"grpo.loss_type": "cispo"}),
    *(compat.Refuse("grpo", key, compat.When(
        f"loss_type other than {owner}", lambda g, owner=owner: g.loss_type != owner),
        f"it is a setting of loss_type {owner}, which this run does not use",
        used=lambda g, key=key: getattr(g, key) != GRPOConfig.model_fields[key].default,
        example={f"grpo.{key}": 1.7})
      for owner, key in (("sapo", "sapo_temperature_pos"), ("sapo", "sapo_temperature_neg"),
                         ("vespo", "vespo_k_pos"), ("vespo", "vespo_lambda_pos"),
                         ("vespo", "vespo_k_neg"), ("vespo", "vespo_lambda_neg"))),
    compat.Refuse("grpo", "scale_rewards", compat.When(
        "multi_objective_aggregation normalize_then_sum",
        lambda g: g.multi_objective_aggregation == "normalize_then_sum"),
        "it normalises each function within its group and the sum over the batch itself",
        used=lambda g: g.scale_rewards != "group",
        example={"grpo.scale_rewards": "batch",
                 "grpo.multi_objective_aggregation": "normalize_then_sum"}),
    compat.Refuse("grpo", "delta", compat.When(
        "loss_type cispo, sapo or vespo", lambda g: g.loss_type in ("cispo", "sapo", "vespo")),
        "delta caps the ratio of the clipped surrogate, which these loss types replace",
        example={"grpo.delta": 1.5, "grpo.loss_type": "sapo"}),
    compat.Agree("grpo", ("reward_weights", "reward_funcs"), _one_weight_per_function,
                 example={"grpo.reward_weights": [1.0, 2.0]}),
    compat.Agree("grpo", ("reward_funcs", "environment_factory"), _a_reward_source,
                 example={"grpo.reward_funcs": []}),
    compat.Agree("grpo", ("delta", "epsilon_high"), _delta_above_the_clip,
                 example={"grpo.delta": 1.1}),
    compat.Refuse("grpo", "off_policy_mask_threshold", compat.When(
        "num_iterations 1", lambda g: g.num_iterations == 1),
        "the completions are sampled from the weights being trained, so no completion is "
        "off-policy and nothing would be masked; use num_iterations > 1",
        used=lambda g: g.off_policy_mask_threshold is not None,
        example={"grpo.off_policy_mask_threshold": 0.5}),
    *(compat.Refuse("config", key, GRPO, why, used=used, example={
        "training.type": "grpo", "data.dataset_type": "prompt",
        "registry.gate_metric": "eval.reward", **extra})
      for key, used, why, extra in (
        ("training.packing", None, "completions are generated and scored as padded rows",
         {"training.packing": True}),
        ("training.padding_free", None, "completions are generated and scored as padded rows",
         {"training.padding_free": True}),
        ("distributed.strategy", lambda c: c.distributed.strategy == "pipeline",
         "generation needs the whole model on each rank; use single, ddp or fsdp2",
         {"distributed.strategy": "pipeline", "distributed.nproc_per_node": 2}),
        ("data.collate_fn", lambda c: c.data.user_collate_fn is not None,  # dynamic_padding is
         "the trainer batches the generated completions itself",  # what it does
         {"data.collate_fn": "m:f"}),
        ("training.compute_loss_func", None, "the loss is grpo.loss_type's",
         {"training.compute_loss_func": "m:f"}),
        ("training.use_liger_kernel", None, "its fused loss is the SFT cross entropy",
         {"training.use_liger_kernel": True}),
        ("training.fused_loss_factory", None, "a fused loss is the SFT cross entropy",
         {"training.fused_loss_factory": "m:f"}),
        ("training.group_by_length", None, "prompts are drawn in seeded order; their "
         "completions' lengths are not known in advance", {"training.group_by_length": True}))),
    compat.Refuse("config", "data.tools", compat.When(
        "grpo.tools", lambda c: c.training.type == "grpo" and bool(c.grpo.tools)),
        "the prompts offer grpo.tools' functions (their schemas, as TRL renders tools=); "
        "tools the rollout cannot run would be offered otherwise: set one", example={
            "training.type": "grpo", "data.dataset_type": "prompt",
            "registry.gate_metric": "eval.reward", "grpo.tools": ["m:f"],
            "data.prompt_template": None,
            "data.tools": [{"name": "f", "parameters": {"type": "object", "properties": {}}}]}),
    compat.Refuse("config", "grpo.tools", SHARDED, SHARDED_WHY,
        used=lambda c: c.training.type == "grpo" and bool(c.grpo.tools), example={
            "training.type": "grpo", "data.dataset_type": "prompt",
            "registry.gate_metric": "eval.reward", "grpo.tools": ["m:f"],
            "data.prompt_template": None, "distributed.strategy": "fsdp2",
            "distributed.nproc_per_node": 2}),
    compat.Refuse("config", "grpo.tools", compat.When(
        "data.prompt_template or data.prompt_func (a string prompt)",
        lambda c: c.data.prompt_template is not None or bool(c.data.prompt_func)),
        "the chat template renders the tools' schemas into a conversation prompt, which a "
        "templated string prompt is not; give the rows a conversational 'prompt' column",
        used=lambda c: c.training.type == "grpo" and bool(c.grpo.tools), example={
            "training.type": "grpo", "data.dataset_type": "prompt",
            "registry.gate_metric": "eval.reward", "grpo.tools": ["m:f"]}),
    *_environment_rows(),
]
compat.add_rows("grpo", ROWS)
