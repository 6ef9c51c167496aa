"""How a next token is drawn from a model's scores, as Hugging Face's `generate` draws it.

Each step's next-token scores go through the processors `generate` applies, in its order and
with its semantics (`process_logits`): repetition penalty over the prompt's real tokens and the
tokens generated so far, temperature, top-k, top-p, min-p; then softmax and
`torch.multinomial`'s draw with a `torch.Generator` the caller seeds (`next_tokens`), so the
same scores and generator state give the same tokens bitwise. Temperature 0 is greedy
(argmax). The names, defaults and conventions of `SamplingParams` are TRL GRPOConfig's
(`top_k=0` is no top-k filtering, `min_p=None` no min-p), so a section with those names maps
onto it (`sampling_params`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled; the names, defaults and conventions are TRL GRPOConfig's."""

    max_completion_length: int
    temperature: float = 1.0          # 0: greedy (argmax), for evaluation
    top_p: float = 1.0                # 1.0: off
    top_k: int = 0                    # 0: off (GRPOConfig's default and convention)
    min_p: float | None = None        # None: off
    repetition_penalty: float = 1.0   # 1.0: off

    def __post_init__(self):
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be an integer >= 1, "
                             f"got {self.max_completion_length!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 is off), got {self.top_k!r}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_params(section, greedy: bool = False) -> SamplingParams:
    """The sampling settings of a config section with TRL's names (max_completion_length,
    temperature, top_p, top_k, repetition_penalty: the `grpo` section's); `greedy`: the
    same at temperature 0, for evaluation."""
    return SamplingParams(max_completion_length=section.max_completion_length,
                          temperature=0.0 if greedy else section.temperature,
                          top_p=section.top_p, top_k=section.top_k,
                          repetition_penalty=section.repetition_penalty)


def token_presence(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab_size + 1] bool: which tokens occur among each row's real (mask 1) tokens.

    The repetition penalty's memory. The last column absorbs what is not a penalised token:
    padding, and ids at or past the output vocabulary (as RepetitionPenaltyLogitsProcessor
    clamps them); `process_logits` reads the first vocab_size columns.
    """
    where = ids.clamp(min=0, max=vocab_size).masked_fill(mask == 0, vocab_size)
    seen = torch.zeros((ids.shape[0], vocab_size + 1), dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, where, True)


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token scores [N, V] -> the scores sampling draws from (filtered tokens at -inf).

    Hugging Face generate's processors, in its order and with its arithmetic:
    RepetitionPenaltyLogitsProcessor (over `seen`, see `token_presence`), then, unless greedy,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, each with
    min_tokens_to_keep=1. Not in place: `logits` may be the model's output.
    """
    scores = logits
    vocab = scores.shape[-1]
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("process_logits: repetition_penalty needs `seen` (token_presence)")
        rp = params.repetition_penalty
        penalized = torch.where(scores < 0, scores * rp, scores / rp)
        scores = torch.where(seen[:, :vocab], penalized, scores)
    if params.greedy:
        return scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, vocab)).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - params.top_p)
        drop_sorted[..., -1:] = False  # min_tokens_to_keep=1: the most likely token stays
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, -float("inf"))
    if params.min_p is not None:
        probs = scores.softmax(dim=-1)
        drop = probs < params.min_p * probs.amax(dim=-1, keepdim=True)
        drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(drop, -float("inf"))
    return scores


def next_tokens(scores: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | Sequence[tuple[int, int, torch.Generator]] | None
                ) -> torch.Tensor:
    """[N, V] processed scores -> [N] token ids: argmax when greedy, else one draw per row.

    `generator`: one generator for every row, or spans (start, end, generator) of rows, each
    span drawn from its own generator in row order. The draw is `torch.multinomial(probs, 1)`'s
    (an exponential noise per score, then argmax of probs / noise), so the same scores and
    generator states give the same tokens bitwise, but without multinomial's host sync: its
    check that no row sums to zero reads a value back on every call, i.e. once per token and
    prompt, which stalls an accelerator's queue; the finiteness check stays, asynchronous as
    multinomial's own."""
    if params.greedy:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    # multinomial's check, on a softmax's output: it lies in [0, 1] or is nan (a row of
    # -inf or with +inf scores), and min() propagates nan, so one comparison checks all
    torch._assert_async(probs.min() >= 0,
                        "probability tensor contains either `inf`, `nan` or element < 0")
    if generator is None or isinstance(generator, torch.Generator):
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
    else:
        noise = torch.cat([torch.empty_like(probs[a:b]).exponential_(1, generator=g)
                           for a, b, g in generator])
    return probs.div(noise).argmax(dim=-1)
