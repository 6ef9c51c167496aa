"""A batch of prompt rows turned into episodes, the one way a method's training rollout and its
held-out evaluation both make completions, so that a reward means the same in both:

- plain: the generator's `num_generations` completions per prompt;
- tools (a `ToolLoop` over the generator, stateless tools): each completion an episode of
  turns and tool results (engine.rollout.multi_turn);
- environments (`Environments`, TRL's environment_factory): every rollout (prompt row x
  generation) gets its own instance from the pool, reset with its row's columns (TRL passes
  the row to `reset(**row)`); reset's text, where it returns one, is appended to the prompt's
  last user message and the prompt rendered again (`render`: the prompt type's own rendering
  and tokenizing, so an unchanged prompt is the same ids); the instance's methods, with the
  stateless tools, are the rollout's tools. Each rollout then samples with its own seed (its
  prompt's seed, its index in the group, turn 0: engine.rollout.multi_turn.turn_seed), so a
  rollout does not depend on the others in the batch, and a resumed run replays it; an
  environment whose `reset` names `seed` gets that seed too (engine.rollout.environment).

`Rollouts` carries what the scoring needs besides the completions: each rollout's prompt as
its reward functions see it (the observation included) and its environment instance
(`environments=`), and, where the prompts differ per rollout, their ids for the training
forward.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.rollout.environment import Environments, tool_methods
from engine.rollout.generator import Completions, Generator, left_pad
from engine.rollout.multi_turn import ToolLoop, turn_seed
from engine.rollout.tools import ToolRunner
from finetune.datatypes.chat import ENVIRONMENT_COLUMN
from finetune.errors import PipelineError


@dataclass
class Rollouts:
    """The completions of B prompt rows x G generations, in TRL's order (prompt 0's first)."""

    done: Completions
    #: [B * G, P'] the prompt each rollout was generated from, left-padded, where they differ
    #: within a group (an environment's observation); None: the rows' prompts, G times each
    prompt_ids: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    #: B * G: the prompt each rollout's reward functions see; None: the rows' own
    prompts: list | None = None
    #: B * G: each rollout's environment instance (reward functions' `environments=`)
    environments: list | None = None

    def forward_prompts(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B * G, P] prompt ids and mask the completions were generated after."""
        if self.prompt_ids is not None:
            return self.prompt_ids, self.prompt_mask
        return (prompt_ids.repeat_interleave(num_generations, dim=0),
                prompt_mask.repeat_interleave(num_generations, dim=0))


def with_observation(prompt: list[dict], observation: Any) -> list[dict]:
    """`prompt` (a conversation) with `observation` appended to its last message's content,
    as TRL does it: text to text, text parts to a content given as parts. A new list: the
    row's own is left as it was."""
    last = dict(prompt[-1])
    content = last.get("content")
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    last["content"] = content + observation
    return [*prompt[:-1], last]


class Episodes:
    """Completions of prompt rows (see the module docstring). `generator`: the model's (the
    plain path); `loop`: a ToolLoop over it (tools, environments); `environments` with
    `tools` (the stateless ones, name -> function), `tool_timeout` and `render(prompt, tools)
    -> ids` for an environment run."""

    def __init__(self, generator: Generator, loop: ToolLoop | None = None,
                 environments: Environments | None = None,
                 tools: dict[str, Callable] | None = None, tool_timeout: float | None = None,
                 render: Callable[[list[dict], list[dict]], list[int]] | None = None):
        if environments is not None and (loop is None or render is None):
            raise ValueError("Episodes: an environment run needs the tool loop and render")
        self.generator, self.loop, self.environments = generator, loop, environments
        self.tools, self.tool_timeout, self.render = dict(tools or {}), tool_timeout, render
        self.pool = environments.pool() if environments is not None else None

    @property
    def counts_tools(self) -> bool:
        """The completions count tool calls (TRL's tools/ statistics)."""
        return self.loop is not None

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 reward_inputs: Sequence[str], num_generations: int,
                 seed: int | Sequence[int]) -> Rollouts:
        """B prompt rows' (left-padded ids, their `reward_inputs` JSON) `num_generations`
        rollouts each; `seed`: the generator's (one for the call, or one per row; an
        environment run takes row j's as seed + j from one for the call)."""
        if self.environments is None:
            source = self.loop if self.loop is not None else self.generator
            return Rollouts(source.generate(prompt_ids, prompt_mask, num_generations, seed))
        seeds = ([int(seed) + j for j in range(prompt_ids.shape[0])] if isinstance(seed, int)
                 else [int(s) for s in seed])
        return self._in_environments(prompt_ids, prompt_mask, reward_inputs, num_generations,
                                     seeds)

    def _in_environments(self, prompt_ids, prompt_mask, reward_inputs, g: int,
                         seeds: list[int]) -> Rollouts:
        envs = self.environments
        rows = [json.loads(r) for r in reward_inputs]
        names = [envs.name_of(row, f"prompt row {i}") for i, row in enumerate(rows)]
        instances = self.pool.draw([n for n in names for _ in range(g)])
        own = [[t for t, m in zip(ids, mask) if m]  # each row's prompt, one host copy
               for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist())]
        rollout_seeds = [turn_seed(seeds[k // g], k % g, 0) for k in range(len(instances))]
        prompts, ids = [], []
        for k, instance in enumerate(instances):
            row, name = rows[k // g], names[k // g]
            # a mapping's `environment` column chose the class; TRL does not pass it to reset
            columns = {c: v for c, v in row.items() if c != ENVIRONMENT_COLUMN or not envs.named}
            if envs.takes_seed(name):
                if "seed" in columns:
                    raise PipelineError(
                        f"prompt row {k // g} has a 'seed' column and "
                        f"{type(instance).__qualname__}.reset takes the rollout's seed as "
                        "seed=: rename the column")
                columns["seed"] = rollout_seeds[k]
            observation = instance.reset(**columns)
            prompt = row.get("prompt")
            if observation is None:
                prompts.append(prompt)
                ids.append(own[k // g])
                continue
            if not isinstance(prompt, list):
                raise PipelineError(
                    f"{type(instance).__qualname__}.reset returned text for prompt row "
                    f"{k // g}, which goes after the prompt's last user message, but the "
                    "row's prompt is a string: give the rows a conversational 'prompt'")
            prompt = with_observation(prompt, observation)
            prompts.append(prompt)
            ids.append(self.render(prompt, envs.schemas[name]))
        ids_t, mask_t = left_pad(ids, self.loop.pad_id)
        ids_t, mask_t = ids_t.to(prompt_ids.device), mask_t.to(prompt_ids.device)
        runners = [ToolRunner({**self.tools, **tool_methods(instance)}, self.tool_timeout)
                   for instance in instances]
        done = self.loop.generate(ids_t, mask_t, 1, rollout_seeds, runners=runners)
        return Rollouts(done, ids_t, mask_t, prompts, instances)
