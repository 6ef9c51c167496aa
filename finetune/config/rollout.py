"""What every online RL method shares (`training.type` grpo, rloo): a section base with the
settings of the rollout (sampling, reward functions, tools, environments, how many
completions per prompt, the clipped ratio's bounds and the reference's weight), its rows of
the compatibility table, and the method's facts, so a method that samples completions and
scores them is its own section class plus a `rollout_method` line, not a copy of GRPO's.

TRL's GRPOConfig and RLOOConfig share these names and meanings; each section adds its own
(grpo's loss types and estimators, rloo's advantage options) and may change a default (TRL's
RLOO samples 2 completions per prompt and weighs the KL at 0.05). engine/rollout/ is the room
that runs them; engine/recipe/grpo/ and engine/recipe/rloo/ the methods.

One difference in meaning from TRL, said where it matters: `training.per_device_train_batch_size`
counts *prompts* here (each gives `num_generations` completions to the micro-batch), where TRL
counts completions: TRL's batch 8 with num_generations 8 is our batch 1.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import field_validator, model_validator

from finetune.config import compat
from finetune.config.methods import Method, method_of, register_method
from finetune.config.model import IA3_EXAMPLE
from finetune.config.model_refs import REGISTERED_MODEL
from finetune.config.reward_refs import BUILT_IN_REWARDS, reward_kind, reward_name
from finetune.config.section import Field, Section

#: the sections of the registered rollout methods (`rollout_method`), by section name
ROLLOUT_SECTIONS: dict[str, type] = {}


class RolloutConfig(Section):
    """The rollout's settings; a method's section subclasses it (`SCOPE`: its name)."""

    SCOPE: ClassVar[str] = ""

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
    beta: float = Field(
        0.0, ge=0, fingerprint=True,
        description="Weight of the KL term to the reference (the base: the adapter disabled "
        "under PEFT, a frozen copy otherwise); 0 loads no reference.")
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
        "last user message; its public methods are the model's tools (beside tools); an "
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
    dynamic_sampling: bool = Field(
        False, fingerprint=True,
        description="DAPO's dynamic sampling: a group whose rewards have no spread (all "
        "equal: no advantage to learn from) is replaced by the group of another train prompt, "
        "drawn seeded by the step and the group's position (so a resumed run and any world "
        "size draw the same), up to max_resample_times rounds; the share replaced is logged "
        "as dynamic_sampling/refilled_ratio.")
    max_resample_times: int = Field(
        3, ge=1, fingerprint=True,
        description="dynamic_sampling: most rounds of replacement per step; a group still "
        "without spread after them is trained on as it is (its advantage is 0).")
    num_generations_eval: int = Field(
        4, ge=1, fingerprint=False,
        description="The evaluate stage's k: pass@k over k completions sampled per held-out "
        "prompt at `temperature` (greedy pass@1 is reported too).")
    use_vllm: bool = Field(
        False, fingerprint=True,
        description="Generate the rollouts on a vLLM server (TRL's name): an OpenAI-compatible "
        "`vllm serve MODEL --enable-lora` at vllm_server_base_url, asked for each prompt's "
        "completions with its seed, and sent the current LoRA adapter before each rollout that "
        "follows an optimizer step (its runtime LoRA API); the server's log-probabilities of "
        "the sampled tokens feed vllm_importance_sampling_correction. Needs peft.use_peft. "
        "The in-training evaluation and the evaluate stage still generate in the process.")
    vllm_mode: Literal["server", "colocate"] = Field(
        "server", fingerprint=False,
        description="How vLLM runs (TRL's name): server, a separate `vllm serve` process at "
        "vllm_server_base_url (the only mode here; TRL's default is colocate, vLLM inside the "
        "training processes, which is refused).")
    vllm_server_base_url: str | None = Field(
        None, fingerprint=False,
        description="The vLLM server's base URL, e.g. http://127.0.0.1:8000 (TRL's name); "
        "use_vllm needs it. The train stage asks it for /v1/models before any training.")
    vllm_server_timeout: float = Field(
        240.0, gt=0, fingerprint=False,
        description="Seconds to wait for the vLLM server to answer before the run starts "
        "(TRL's name and default); one that does not answer by then stops the train stage "
        "with one line.")
    vllm_importance_sampling_correction: bool = Field(
        True, fingerprint=True,
        description="Correct the mismatch between the server's log-probabilities of the "
        "sampled tokens and the training forward's (TRL's name and default): the loss of each "
        "token is multiplied by exp(log pi_old - log pi_vllm), per token or per completion, "
        "truncated or masked as vllm_importance_sampling_mode says; logs "
        "sampling/sampling_logp_difference/* and sampling/importance_sampling_ratio/*. Only "
        "with use_vllm.")
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "sequence_mask", fingerprint=True,
        description="How the importance-sampling ratio is taken (TRL's names and default): "
        "per token or per completion (the exp of the summed token log-ratios), and a ratio "
        "outside [clip_min, clip_max] clamped to it (truncate) or set to 0 (mask).")
    vllm_importance_sampling_clip_min: float | None = Field(
        None, fingerprint=True,
        description="The importance-sampling ratio's lower bound C_min (TRL's name; null: "
        "none): truncate modes clamp below it, mask modes zero what is below it.")
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0, fingerprint=True,
        description="The importance-sampling ratio's upper bound C_max (TRL's name and "
        "default; null: none): truncate modes clamp above it, mask modes zero what is above "
        "it.")

    @field_validator("vllm_server_base_url")
    @classmethod
    def _a_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"'{url}' is not an http:// or https:// URL (e.g. "
                             "http://127.0.0.1:8000)")
        return url.rstrip("/") if url else url

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
    def _compat(self) -> "RolloutConfig":
        compat.check(self, self.SCOPE)
        return self

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def corrects_sampling(self) -> bool:
        """The loss takes vLLM's importance-sampling correction (use_vllm and
        vllm_importance_sampling_correction)."""
        return self.use_vllm and self.vllm_importance_sampling_correction


def rollout_section(cfg) -> RolloutConfig:
    """The rollout section the run of `cfg` reads: its method's own (`Method.own_sections`:
    rloo's for training.type rloo, a project's run class's as its `method` declares), else
    the `section` a project's `module:Class` run class inherits (RLOORun's rloo), else grpo's."""
    kind = cfg.training.type
    for name in method_of(kind).own_sections:
        if name in ROLLOUT_SECTIONS:
            return getattr(cfg, name)
    if ":" in kind:
        from finetune.imports import load_object

        try:
            inherited = getattr(load_object(kind, "training.type"), "section", None)
        except Exception:  # the engine's check names the broken reference (engine.preflight)
            inherited = None
        if inherited in ROLLOUT_SECTIONS:
            return getattr(cfg, inherited)
    return cfg.grpo


def section_name(cfg) -> str:
    """The name of `rollout_section(cfg)` as keys are spelled (`grpo`, `rloo`)."""
    return rollout_section(cfg).SCOPE


def reported_metrics(cfg) -> tuple[str, ...]:
    """The evaluate stage's metrics of a rollout method (engine.recipe.grpo.heldout): the
    weighted reward, one per function (named as the metrics are: a built-in's name, a
    function's own), and with the correctness reward its pass rates."""
    g = rollout_section(cfg)
    names = [reward_name(ref) for ref in g.reward_funcs]
    passes = ("pass_at_1", f"pass_at_{g.num_generations_eval}") if "correctness" in names else ()
    rewards = ("reward", *(f"reward_{n}" for n in names))
    return (*rewards, *(f"sampled_{r}" for r in rewards), *passes)


def rollout_method(section: type[RolloutConfig], rows: list[compat.Rule]) -> Method:
    """Registers a rollout method: its facts (prompt-only rows, the evaluate stage's rewards
    as its metrics and gate, its section's tools and environments rendered into the prompts)
    and its rows of the compatibility table, the shared ones (`shared_rows`) plus `rows`."""
    name = section.SCOPE
    ROLLOUT_SECTIONS[name] = section
    compat.add_rows(name, [*shared_rows(name), *rows])
    return register_method(Method(
        name, accepts=("none",), data_hint=(
            "trains on prompt-only rows (completions are generated during training); set "
            "data.dataset_type: prompt"), metrics=reported_metrics,
        metric_pattern=r"(sampled_)?reward(_\w+)?|pass_at_\d+",
        stderr=lambda cfg, metric: False,  # rewards of sampled completions: no bootstrap here
        prompt_tools=lambda cfg: getattr(cfg, name).tools,
        prompt_environments=lambda cfg: getattr(cfg, name).environment_factory,
        default_gate="eval.reward"))


#: what a multi-turn rollout (tools, environments) cannot run under yet, and why
SHARDED = compat.When(
    "sharded weights (distributed.strategy fsdp2, or diloco with fsdp_group_size > 1)",
    lambda c: c.distributed.strategy == "fsdp2" or (
        c.distributed.strategy == "diloco" and c.distributed.diloco is not None
        and c.distributed.diloco.fsdp_group_size > 1))
SHARDED_WHY = ("every generation forward gathers the shards, so every rank must run as many "
               "turns as the rank that calls tools longest, which the tool loop does not do "
               "yet; use distributed.strategy ddp or single")


def _one_weight_per_function(g: RolloutConfig) -> str | None:
    if g.reward_weights is None or len(g.reward_weights) == len(g.reward_funcs):
        return None
    return (f"reward_weights has {len(g.reward_weights)} weights for {len(g.reward_funcs)} "
            "reward_funcs; give one per function or null")


def _a_reward_source(g: RolloutConfig) -> str | None:
    if g.reward_funcs or g.environment_factory:
        return None
    return ("reward_funcs is empty and there is no environment_factory: name a reward "
            "function (e.g. [correctness]) or an environment whose class scores its rollouts "
            "(get_reward)")


def _a_server(g: RolloutConfig) -> str | None:
    if not g.use_vllm or g.vllm_server_base_url:
        return None
    return ("use_vllm: true needs vllm_server_base_url, the vLLM server's URL (e.g. "
            "http://127.0.0.1:8000, where `vllm serve MODEL --enable-lora` listens)")


def _ordered_bounds(g: RolloutConfig) -> str | None:
    low, high = g.vllm_importance_sampling_clip_min, g.vllm_importance_sampling_clip_max
    if low is None or high is None or low < high:
        return None
    return (f"vllm_importance_sampling_clip_min {low} is not below "
            f"vllm_importance_sampling_clip_max {high}; set it lower (TRL refuses it too)")


def _a_truncation_bound(g: RolloutConfig) -> str | None:
    if not (g.vllm_importance_sampling_correction
            and g.vllm_importance_sampling_mode.endswith("_truncate")
            and g.vllm_importance_sampling_clip_min is None
            and g.vllm_importance_sampling_clip_max is None):
        return None
    return (f"vllm_importance_sampling_mode {g.vllm_importance_sampling_mode} clamps the ratio "
            "to [vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max], and "
            "both are null; set one (TRL's default clip_max is 3.0)")


def vllm_rows(name: str, base: dict) -> list[compat.Rule]:
    """use_vllm's rows for section `name`: what the server path cannot run, each refused."""
    section = lambda c: getattr(c, name)  # noqa: E731
    used = lambda c: c.training.type == name and section(c).use_vllm  # noqa: E731
    on = {**base, f"{name}.use_vllm": True,
          f"{name}.vllm_server_base_url": "http://127.0.0.1:8000"}
    key = f"{name}.use_vllm"

    def refuse(where: str, holds, why: str, extra: dict) -> compat.Refuse:
        return compat.Refuse("config", key, compat.When(where, holds), why, used=used,
                             example={**on, **extra})

    plain_lora = ("vLLM's runtime LoRA API (/v1/load_lora_adapter) applies a plain LoRA "
                  "adapter to the base model it serves")
    return [
        compat.Agree(name, ("use_vllm", "vllm_server_base_url"), _a_server,
                     example={f"{name}.use_vllm": True}),
        compat.Agree(name, ("vllm_importance_sampling_clip_min",
                            "vllm_importance_sampling_clip_max"), _ordered_bounds,
                     example={f"{name}.vllm_importance_sampling_clip_min": 3.0}),
        compat.Agree(name, ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max"),
                     _a_truncation_bound,
                     example={f"{name}.vllm_importance_sampling_mode": "token_truncate",
                              f"{name}.vllm_importance_sampling_correction": True,
                              f"{name}.vllm_importance_sampling_clip_max": None}),
        compat.Refuse(name, "vllm_mode", compat.When(
            "use_vllm true", lambda g: g.use_vllm),
            "vLLM colocate needs vLLM installed in the training process on a GPU, which this "
            "pipeline does not run; start `vllm serve MODEL --enable-lora` and use vllm_mode "
            "server with vllm_server_base_url", used=lambda g: g.vllm_mode == "colocate",
            example={**on, f"{name}.vllm_mode": "colocate"}),
        refuse("peft.use_peft false (full fine-tuning)", lambda c: not c.peft.use_peft,
               "the server takes new weights only as a LoRA adapter through its runtime LoRA "
               "API, so it would keep sampling from the base; train an adapter (peft.use_peft "
               "true) or set use_vllm false", {"peft.use_peft": False}),
        refuse("peft.peft_type IA3", lambda c: c.peft.use_peft and c.peft.peft_type != "LORA",
               plain_lora + "; use peft_type LORA or use_vllm false",
               IA3_EXAMPLE),
        refuse("peft.use_dora", lambda c: c.peft.use_peft and c.peft.use_dora,
               plain_lora + " (no DoRA magnitudes); set use_dora false or use_vllm false",
               {"peft.use_dora": True}),
        refuse("peft.init_lora_weights pissa or olora",
               lambda c: c.peft.use_peft and isinstance(c.peft.init_lora_weights, str)
               and c.peft.init_lora_weights.startswith(("pissa", "olora")),
               plain_lora + ", and these move part of the base weights into the adapter; use "
               "init_lora_weights true or use_vllm false",
               {"peft.init_lora_weights": "olora"}),
        refuse("peft.modules_to_save", lambda c: c.peft.use_peft and bool(c.peft.modules_to_save),
               plain_lora + " (no fully trained modules); set modules_to_save null or use_vllm "
               "false", {"peft.modules_to_save": ["lm_head"]}),
        refuse("peft.target_parameters",
               lambda c: c.peft.use_peft and bool(c.peft.target_parameters),
               plain_lora + " over modules, not parameters; use target_modules or use_vllm "
               "false", {"peft.target_parameters": ["mlp.experts.gate_up_proj"]}),
        refuse(f"{name}.tools", lambda c: bool(section(c).tools),
               "the tool loop joins turns and tool results into one completion in this "
               "process and does not carry the server's log-probabilities across them; set "
               "use_vllm false for tool runs",
               {f"{name}.tools": ["m:f"], "data.prompt_template": None}),
        refuse(f"{name}.environment_factory", lambda c: bool(section(c).environment_factory),
               "an environment's episodes run the tool loop in this process, which does not "
               "carry the server's log-probabilities across tool results; set use_vllm false "
               "for environment runs",
               {f"{name}.environment_factory": "m:Env", "data.prompt_template": None}),
        refuse(f"{name}.dynamic_sampling", lambda c: section(c).dynamic_sampling,
               "a refilled group's rows are joined by a path that does not carry the server's "
               "log-probabilities; set dynamic_sampling false or use_vllm false",
               {f"{name}.dynamic_sampling": True}),
        refuse("distributed.strategy fsdp2, diloco or pipeline",
               lambda c: c.distributed.strategy in ("fsdp2", "diloco", "pipeline"),
               "the adapter sent to the server is saved whole by rank 0 (ddp and single keep "
               "every rank's weights equal; sharded or per-worker weights are not); use "
               "distributed.strategy ddp or single",
               {"distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2}),
    ]


def shared_rows(name: str) -> list[compat.Rule]:
    """The rows every rollout method has, for its section `name`: within the section, and
    across the config where `training.type` is `name`."""
    trains = compat.When(f"training.type {name}", lambda c: c.training.type == name)
    section = lambda c: getattr(c, name)  # noqa: E731
    base = {"training.type": name, "data.dataset_type": "prompt",
            "registry.gate_metric": "eval.reward"}
    tools_used = lambda c: c.training.type == name and bool(section(c).tools)  # noqa: E731
    env_used = (lambda c: c.training.type == name  # noqa: E731
                and bool(section(c).environment_factory))
    env = {**base, f"{name}.environment_factory": "m:Env", "data.prompt_template": None}
    string_prompt = compat.When(
        "data.prompt_template or data.prompt_func (a string prompt)",
        lambda c: c.data.prompt_template is not None or bool(c.data.prompt_func))
    one_tool = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]
    return [
        *vllm_rows(name, base),
        compat.Agree(name, ("reward_weights", "reward_funcs"), _one_weight_per_function,
                     example={f"{name}.reward_weights": [1.0, 2.0]}),
        compat.Agree(name, ("reward_funcs", "environment_factory"), _a_reward_source,
                     example={f"{name}.reward_funcs": []}),
        *(compat.Refuse("config", key, trains, why, used=used, example={**base, **extra})
          for key, used, why, extra in (
            ("training.packing", None, "completions are generated and scored as padded rows",
             {"training.packing": True}),
            ("training.padding_free", None,
             "completions are generated and scored as padded rows",
             {"training.padding_free": True}),
            ("distributed.strategy", lambda c: c.distributed.strategy == "pipeline",
             "generation needs the whole model on each rank; use single, ddp or fsdp2",
             {"distributed.strategy": "pipeline", "distributed.nproc_per_node": 2}),
            ("data.collate_fn", lambda c: c.data.user_collate_fn is not None,  # what
             "the trainer batches the generated completions itself",  # dynamic_padding is
             {"data.collate_fn": "m:f"}),
            ("training.compute_loss_func", None, f"the loss is {name}'s own",
             {"training.compute_loss_func": "m:f"}),
            ("training.use_liger_kernel", None, "its fused loss is the SFT cross entropy",
             {"training.use_liger_kernel": True}),
            ("training.fused_loss_factory", None, "a fused loss is the SFT cross entropy",
             {"training.fused_loss_factory": "m:f"}),
            ("training.group_by_length", None, "prompts are drawn in seeded order; their "
             "completions' lengths are not known in advance",
             {"training.group_by_length": True}))),
        compat.Refuse("config", "data.tools", compat.When(f"{name}.tools", tools_used),
            f"the prompts offer {name}.tools' functions (their schemas, as TRL renders "
            "tools=); tools the rollout cannot run would be offered otherwise: set one",
            example={**base, f"{name}.tools": ["m:f"], "data.prompt_template": None,
                     "data.tools": one_tool}),
        compat.Refuse("config", f"{name}.tools", SHARDED, SHARDED_WHY, used=tools_used,
            example={**base, f"{name}.tools": ["m:f"], "data.prompt_template": None,
                     "distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2}),
        compat.Refuse("config", f"{name}.tools", string_prompt,
            "the chat template renders the tools' schemas into a conversation prompt, which a "
            "templated string prompt is not; give the rows a conversational 'prompt' column",
            used=tools_used, example={**base, f"{name}.tools": ["m:f"]}),
        # an environment's methods are tools rendered into a conversational prompt, and they
        # change the instance's state, which a call run in a child process would lose
        compat.Refuse("config", "data.tools", compat.When(
            f"{name}.environment_factory", env_used),
            "the prompts offer the environment's methods (their schemas, as TRL renders "
            "them); tools the rollout cannot run would be offered otherwise: set one",
            example={**env, "data.tools": one_tool}),
        compat.Refuse("config", f"{name}.environment_factory", SHARDED, SHARDED_WHY,
            used=env_used, example={**env, "distributed.strategy": "fsdp2",
                                    "distributed.nproc_per_node": 2}),
        compat.Refuse("config", f"{name}.environment_factory", string_prompt,
            "reset's text is appended to the prompt's last user message and the chat template "
            "renders the environment's tools, so the rows need a conversational 'prompt' "
            "column", used=env_used, example={**env, "data.prompt_template": "Q: {question}"}),
        compat.Refuse("config", f"{name}.dynamic_sampling", SHARDED,
            "a refilled group is generated on the rank that holds it, and every generation "
            "forward over sharded weights needs every rank; use distributed.strategy ddp or "
            "single", used=lambda c: c.training.type == name and section(c).dynamic_sampling,
            example={**base, f"{name}.dynamic_sampling": True,
                     "distributed.strategy": "fsdp2", "distributed.nproc_per_node": 2}),
        compat.Refuse("config", f"{name}.dynamic_sampling", compat.When(
            "data.streaming", lambda c: c.data.streaming),
            "refills are drawn from the tokenized train split by position, which a stream "
            "does not have", used=lambda c: c.training.type == name
            and section(c).dynamic_sampling,
            example={**base, f"{name}.dynamic_sampling": True, "data.streaming": True}),
        compat.Refuse("config", f"{name}.environment_factory", compat.When(
            f"{name}.tool_sandbox subprocess",
            lambda c: getattr(c, name).tool_sandbox == "subprocess"),
            "an environment's methods change its state, which a call run in a child process "
            "would lose; run its calls in the worker (tool_sandbox: none) and give code-running "
            "tools their own limits", used=env_used,
            example={**env, f"{name}.tool_sandbox": "subprocess"}),
    ]
