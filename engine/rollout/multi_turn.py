"""Multi-turn rollouts with tools: a `Generator` that wraps another and, while a completion
calls tools, runs the calls, appends their results and lets the model continue, as TRL 1.16's
GRPOTrainer does in `_tool_call_loop`, so a run trains on whole episodes.

One episode per completion row:

1. the inner generator's first turn: `num_generations` completions per prompt, as without tools;
2. each completion's calls are parsed from its text (finetune.datatypes.tool_calls, the
   template-free parser) and run by that row's `ToolRunner` (stateless tools, or the bound
   methods of the row's environment): each result becomes a `tool` message;
3. the tool messages' tokens are the chat template's own rendering of them after an assistant
   turn (`tool_suffix_ids`: the delta of a small conversation with and without them, ending in
   the generation prompt), appended to the episode's ids as they are: no re-tokenization of
   what the model wrote;
4. the rows that called a tool continue, one completion each (`num_generations=1`), seeded per
   row and turn, in one batched call of the inner generator;
5. until a turn calls no tool, `max_iterations` rounds of calls ran, or the episode would pass
   `max_completion_length` tokens. Tool results that would pass it (or the model's positions)
   are dropped and the episode ends as it was (TRL's rollback); a last turn is cut to the
   length left.

The result is one `Completions` whose `trained` mask is 0 on the tool results' tokens (the
model did not write them: no loss on them) and 1 on every token the model generated. A row's
sampling depends only on its own prompt's seed, its index in the group and the turn, so an
episode is the same whatever else is in the batch, and a resumed run replays it bitwise.

Parsing and running the calls is host work per row (text in, text out); the generation of each
turn stays one batched call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.rollout.generator import Completions, Generator, left_pad
from engine.rollout.tools import ToolRunner
from finetune.datatypes.tool_calls import parse_tool_calls
from finetune.errors import PipelineError


def turn_seed(seed: int, generation: int, turn: int) -> int:
    """The sampling seed of a row's turn `turn` (>= 1): its prompt's seed, its index in the
    prompt's group and the turn, mixed as engine.recipe.grpo.run.prompt_seeds mixes steps."""
    return ((seed * 1_000_003 + generation) * 1_000_033 + turn) % (2**63 - 1)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], chat_template: str | None = None
                    ) -> list[int]:
    """The token ids the chat template puts after an assistant turn that called tools: the
    `tool` messages, then the generation prompt of the next assistant turn. Rendered as the
    delta between a one-call conversation and the same followed by `tool_messages` (the name of
    the first result as the dummy call's, since some templates head a result with it); the
    shorter rendering is cut after its last EOS, where a generated turn ends. One line if the
    template does not render the shorter conversation as the start of the longer one."""
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function",
                  "function": {"name": tool_messages[0]["name"], "arguments": {}}}]}]
    kwargs = {"tokenize": True, "return_dict": False, "chat_template": chat_template}
    prefix = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **kwargs))
    full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True,
                                              **kwargs))
    eos = tokenizer.eos_token_id
    ends = [i for i, t in enumerate(prefix) if t == eos]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise PipelineError("the chat template renders a conversation's tool results in a way "
                            "that changes the turns before them; tool-calling rollouts need a "
                            "template that appends each message (as Qwen2.5, Llama 3.1 and "
                            "Qwen3 templates do)")
    return full[len(prefix):]


class ToolLoop:
    """A `Generator` over `inner` whose completions are whole tool-calling episodes (see the
    module docstring). Each completion row's calls run through its `ToolRunner`: `runners`
    (per `generate` call) holds one per row, B * num_generations of them in row order (an
    environment's bound methods), else `runner` (stateless tools) serves every row. The
    `Completions` count each row's calls and failed calls (TRL's tools/call_frequency is calls
    over completions, tools/failure_frequency failures over calls)."""

    def __init__(self, inner: Generator, tokenizer, max_iterations: int | None,
                 max_completion_length: int, max_positions: int | None = None,
                 chat_template: str | None = None, runner: ToolRunner | None = None):
        self.inner, self.tokenizer, self.runner = inner, tokenizer, runner
        self.max_iterations = max_iterations
        self.max_completion_length = max_completion_length
        self.max_positions = max_positions
        self.chat_template = chat_template
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
            tokenizer.eos_token_id)

    def calls_in(self, ids: list[int]) -> list[dict]:
        return parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=True))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int, seed: int | Sequence[int],
                 runners: Sequence[ToolRunner] | None = None) -> Completions:
        first = self.inner.generate(prompt_ids, prompt_mask, num_generations, seed)
        rows = first.ids.shape[0]
        if runners is None and self.runner is not None:
            runners = [self.runner] * rows
        runners = runners or ()
        if len(runners) != rows:
            raise ValueError(f"ToolLoop: {len(runners)} tool runners for {rows} completions")
        seeds = ([int(seed)] * prompt_ids.shape[0] if isinstance(seed, int)
                 else [int(s) for s in seed])
        # the host's copies, each read back once: the loop's work on them is per row
        prompts = [[t for t, m in zip(ids, mask) if m]
                   for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist())]
        lengths, clipped = first.lengths.tolist(), first.clipped.tolist()
        episodes = [ids[:n] for ids, n in zip(first.ids.tolist(), lengths)]
        trained = [[1] * len(e) for e in episodes]
        calls, failures = [0] * rows, [0] * rows
        pending = {i: c for i in range(rows) if (c := self.calls_in(episodes[i]))}
        turn = 0
        while pending and (self.max_iterations is None or turn < self.max_iterations):
            turn += 1
            going, suffixes = [], []
            for i, asked in pending.items():
                results = [runners[i](call) for call in asked]
                calls[i] += len(results)
                failures[i] += sum(r.failed for r in results)
                suffix = tool_suffix_ids(self.tokenizer, [
                    {"role": "tool", "name": r.name, "content": r.content} for r in results],
                    self.chat_template)
                total = len(prompts[i // num_generations]) + len(episodes[i]) + len(suffix)
                if (len(episodes[i]) + len(suffix) > self.max_completion_length
                        or (self.max_positions and total >= self.max_positions)):
                    continue  # the results would not fit: the episode ends as it was
                going.append(i)
                suffixes.append(suffix)
            if not going:
                break
            ids, mask = left_pad([prompts[i // num_generations] + episodes[i] + s
                                  for i, s in zip(going, suffixes)], self.pad_id)
            more = self.inner.generate(
                ids.to(prompt_ids.device), mask.to(prompt_ids.device), 1,
                [turn_seed(seeds[i // num_generations], i % num_generations, turn)
                 for i in going])
            more_lengths, more_clipped = more.lengths.tolist(), more.clipped.tolist()
            more_ids = more.ids.tolist()
            pending = {}
            for k, (i, suffix) in enumerate(zip(going, suffixes)):
                room = self.max_completion_length - len(episodes[i]) - len(suffix)
                new = more_ids[k][:more_lengths[k]]
                cut = len(new) > room
                new = new[:room]
                episodes[i] += suffix + new
                trained[i] += [0] * len(suffix) + [1] * len(new)
                clipped[i] = bool(more_clipped[k] or cut)
                if new and (asked := self.calls_in(new)):
                    pending[i] = asked
        done = self._completions(episodes, trained, clipped, first.ids.device)
        done.tool_calls = torch.tensor(calls, device=first.ids.device)
        done.tool_failures = torch.tensor(failures, device=first.ids.device)
        return done

    def _completions(self, episodes: list[list[int]], trained: list[list[int]],
                     clipped: list[bool], device: torch.device) -> Completions:
        width = max(1, max(len(e) for e in episodes))
        ids = torch.full((len(episodes), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(episodes), width), dtype=torch.long)
        keep = torch.zeros((len(episodes), width), dtype=torch.long)
        for row, (episode, learn) in enumerate(zip(episodes, trained)):
            ids[row, :len(episode)] = torch.as_tensor(episode, dtype=torch.long)
            mask[row, :len(episode)] = 1
            keep[row, :len(learn)] = torch.as_tensor(learn, dtype=torch.long)
        return Completions(ids=ids.to(device), mask=mask.to(device),
                           lengths=mask.sum(1).to(device),
                           clipped=torch.tensor(clipped, dtype=torch.bool, device=device),
                           trained=keep.to(device))
