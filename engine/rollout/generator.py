"""The seam between a method's rollout and whatever produces its completions.

`Generator` is what a run asks for completions and `Completions` what it gets back, so the
run does not change with the backend: `engine.rollout.local.LocalGenerator` generates in the
training process with the live weights; `engine.rollout.vllm_server.VLLMServerGenerator` asks
a vLLM server (the adapter pushed to it after each optimizer step). Conventions are TRL's
(GRPOTrainer): completions of prompt 0 come first (`repeat_interleave` order); the completion
mask covers the tokens up to and including the first EOS; a completion without EOS within
`max_completion_length` is clipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Completions:
    """B * num_generations completions, the num_generations of prompt 0 first.

    T is the longest completion's length (<= max_completion_length), as TRL pads them.
    """

    ids: torch.Tensor      # [N, T] long: token ids, right-padded with pad_token_id after the end
    mask: torch.Tensor     # [N, T] long: 1 up to and including the first EOS, 0 after
    lengths: torch.Tensor  # [N] long: mask.sum(1), the EOS counted
    clipped: torch.Tensor  # [N] bool: no EOS within max_completion_length (TRL's clipped_ratio)
    #: [N, T] long, or None (every masked token): 1 on the tokens the model generated, 0 on
    #: those it did not write (a multi-turn episode's tool results: engine.rollout.multi_turn),
    #: which the loss must not train on; TRL's tool_mask
    trained: torch.Tensor | None = None
    #: [N] long each, or None (no tools): the tool calls each completion made, and how many
    #: of them failed (engine.rollout.multi_turn)
    tool_calls: torch.Tensor | None = None
    tool_failures: torch.Tensor | None = None
    #: [N, T] float32, or None (LocalGenerator: the run's own forward is the sampler): the
    #: log-probability the sampler gave each sampled token (a vLLM server's,
    #: engine.rollout.vllm_server), 0 after the end, NaN where the sampler gave none; what
    #: vLLM's importance-sampling correction compares the training forward's with
    sampling_logps: torch.Tensor | None = None


@runtime_checkable
class Generator(Protocol):
    """What a run asks for completions (GRPO's rollout today); the seam for other backends.

    `LocalGenerator` generates in this process with the policy's live weights. The vLLM
    server generator (the adapter pushed to the server after each optimizer step) implements
    the same method: it takes the same left-padded prompts, returns the same
    `Completions` on the prompts' device, and honours the same `seed` and row order, so the run
    does not change with the backend. The loss differentiates the run's own forward's
    log-probabilities (its precision, its mode); a generator whose sampler is another engine
    (engine.rollout.vllm_server) also returns that sampler's (`Completions.sampling_logps`), so
    the run can correct for the mismatch (TRL's vllm_importance_sampling_correction).
    """

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int, seed: int | Sequence[int]) -> Completions:
        """prompt_ids, prompt_mask: [B, P] LEFT-padded prompts on the model's device. Returns
        B * num_generations rows, the num_generations completions of prompt 0 first (TRL's
        repeat_interleave order). The same weights, prompts and seed give the same completions
        bitwise. `seed`: one for the call, or B, one per prompt: a prompt's completions then
        depend on its own seed only, not on the other prompts of the call."""
        ...


def check_request(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  num_generations: int) -> None:
    """What every `Generator.generate` refuses: prompts and mask of different or non-[B, P]
    shapes, fewer than one completion per prompt."""
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids and prompt_mask must both be [B, P], got "
                         f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids, mask), both [len(seqs), longest] long, padded on the left."""
    if not seqs:
        raise ValueError("left_pad: no sequences")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, width - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids, mask
