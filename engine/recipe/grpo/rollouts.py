"""How a rollout method's section (grpo, rloo: finetune.config.rollout.rollout_section) becomes
its episodes (engine.rollout.episodes), for the training rollout and the held-out evaluation
alike: its tools and environment_factory put the generator in the tool loop
(max_tool_calling_iterations, max_completion_length, the model's
positions), an environment's prompts are rendered again by the dataset type that rendered them
first, and an environment that owns its reward adds a reward function named after its class
(weight 1, after reward_funcs' own weights), as TRL's GRPOTrainer adds it."""

from __future__ import annotations

from pathlib import Path

from engine.rollout.environment import Environments, environment_reward, load_environments
from engine.rollout.episodes import Episodes
from engine.rollout.rewards import RewardFunction
from finetune.config.rollout import rollout_section


def key(cfg, name: str) -> str:
    """A rollout key as messages spell it: `grpo.tools`, `rloo.environment_factory`."""
    return f"{rollout_section(cfg).SCOPE}.{name}"


def load_grpo_environments(cfg) -> Environments | None:
    """The section's environment_factory loaded (one probe instance of each class), or
    None."""
    g = rollout_section(cfg)
    if not g.environment_factory:
        return None
    from engine.rollout.tools import load_tools

    return load_environments(g.environment_factory, key(cfg, "environment_factory"),
                             load_tools(g.tools, key(cfg, "tools")))


def environment_rewards(environments: Environments | None) -> list[RewardFunction]:
    """A reward function per environment class that owns its reward (`get_reward`)."""
    if environments is None:
        return []
    return [RewardFunction(klass.__name__, environment_reward(klass))
            for klass in environments.reward_classes]


def reward_weights(cfg, count: int) -> list[float]:
    """reward_weights (all 1 when null) for reward_funcs, then 1 for each of the
    `count - len(reward_funcs)` environment rewards after them."""
    g = rollout_section(cfg)
    own = list(g.reward_weights or [1.0] * len(g.reward_funcs))
    return own + [1.0] * (count - len(own))


def make_episodes(cfg, tokenizer, generator, root: Path,
                  environments: Environments | None = None) -> Episodes:
    """The episodes of `generator`'s completions under the rollout section (see the module
    docstring)."""
    g = rollout_section(cfg)
    if not g.tools and environments is None:
        return Episodes(generator)
    from engine.modeling.model import max_positions
    from engine.rollout.multi_turn import ToolLoop
    from engine.rollout.tools import ToolRunner, load_tools

    tools = load_tools(g.tools, key(cfg, "tools"))
    runner = ToolRunner(tools, g.tool_timeout, g.tool_sandbox) if environments is None else None
    loop = ToolLoop(generator, tokenizer, g.max_tool_calling_iterations,
                    g.max_completion_length, max_positions(cfg.model, root), runner=runner)
    render = None
    if environments is not None:
        from finetune.datatypes.base import DataContext
        from finetune.datatypes.registry import type_class
        from finetune.errors import PipelineError

        datatype = type_class(cfg.data.dataset_type)(cfg.data)
        if not hasattr(datatype, "prompt_encoder"):
            raise PipelineError(f"{key(cfg, 'environment_factory')}: data.dataset_type "
                                f"{cfg.data.dataset_type} has no prompt_encoder to render a "
                                "prompt an environment's reset changed; use dataset_type prompt")
        render = datatype.prompt_encoder(DataContext(root, lambda: tokenizer))
    return Episodes(generator, loop, environments, tools, g.tool_timeout, render)
