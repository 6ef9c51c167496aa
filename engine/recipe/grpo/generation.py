"""Completions for GRPO: `num_generations` samples per prompt from the policy's current weights.

`Generator` is the seam between the GRPO run and whatever produces its completions;
`LocalGenerator` generates in this process with the model being trained (a plain Hugging Face
causal LM or a peft `PeftModel` around one), batched over every row at once with a KV cache:
one prefill forward of the repeated prompts, then one forward per new token.

Each step's next-token scores go through the processors Hugging Face's `generate` applies, in
its order and with its semantics (`process_logits`): repetition penalty over the prompt's real
tokens and the tokens generated so far, temperature, top-k, top-p, min-p; then softmax and
`torch.multinomial` with a `torch.Generator` on the device seeded by the caller, so the same
weights, prompts and seed give the same completions bitwise (on one device and software stack;
on CUDA as far as the model's kernels are deterministic). With one seed for the call and
unchunked, they are the tokens `model.generate(do_sample=True, num_return_sequences=G)` draws
after `torch.manual_seed(seed)` (tests/test_grpo_generation.py and bench/grpo_generation.py check
it on the CPU). With one seed per prompt, each prompt's completions are drawn from its own
generator: they do not depend on which other prompts share the call (the forwards stay batched;
only the draw is one `torch.multinomial` per prompt). Temperature 0 is greedy (argmax).

Through a peft LoRA model computing in float32 on the CPU, generation folds each LoRA linear
layer's adapters into one weight for the call (`merged_lora`: W + B A s, one GEMM where the
adapter's forward runs three): the policy's distribution up to float rounding (the training
forward, which the loss differentiates, keeps the unmerged layers); 1.38x (64 new tokens) and
1.48x (128) faster on stories260K with LoRA r=16 on every linear layer, 16 rows, on the 2-core
dev CPU. `merge_adapters` (LocalGenerator) turns it on or off elsewhere.

Conventions are TRL's (GRPOTrainer, GRPOConfig): `top_k=0` is no top-k filtering, `min_p=None`
no min-p; completions of prompt 0 come first (`repeat_interleave` order); the completion mask
covers the tokens up to and including the first EOS; a completion without EOS within
`max_completion_length` is clipped.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

#: On an accelerator the decode loop asks "has every row finished?" only every this many new
#: tokens: the answer is a device-to-host copy that makes the host wait for the queued kernels,
#: and asking every token would stall the launch queue once per token. The cost is at most this
#: many extra forwards after the last row finishes (their tokens are pad, masked out). On the
#: CPU nothing is queued, so it asks every token.
STOP_CHECK_EVERY = 16


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


@dataclass
class Completions:
    """B * num_generations completions, the num_generations of prompt 0 first.

    T is the longest completion's length (<= max_completion_length), as TRL pads them.
    """

    ids: torch.Tensor      # [N, T] long: token ids, right-padded with pad_token_id after the end
    mask: torch.Tensor     # [N, T] long: 1 up to and including the first EOS, 0 after
    lengths: torch.Tensor  # [N] long: mask.sum(1), the EOS counted
    clipped: torch.Tensor  # [N] bool: no EOS within max_completion_length (TRL's clipped_ratio)


@runtime_checkable
class Generator(Protocol):
    """What the GRPO run asks for completions; the seam for other backends.

    `LocalGenerator` generates in this process with the policy's live weights. A later vLLM
    generator (a `trl vllm-serve` style server, weights pushed to it after each optimizer step)
    implements the same method: it takes the same left-padded prompts, returns the same
    `Completions` on the prompts' device, and honours the same `seed` and row order, so the run
    does not change with the backend. Generators return no log-probabilities: the run computes
    them with its own forward (its precision, its mode), which is what its loss differentiates.
    """

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int, seed: int | Sequence[int]) -> Completions:
        """prompt_ids, prompt_mask: [B, P] LEFT-padded prompts on the model's device. Returns
        B * num_generations rows, the num_generations completions of prompt 0 first (TRL's
        repeat_interleave order). The same weights, prompts and seed give the same completions
        bitwise. `seed`: one for the call, or B, one per prompt: a prompt's completions then
        depend on its own seed only, not on the other prompts of the call."""
        ...


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
                generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] processed scores -> [N] token ids: argmax when greedy, else one multinomial draw."""
    if params.greedy:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM (under a peft wrapper, if any) can return the last position's
    logits only: a prefill then never holds [N, P, V] logits."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def _foldable_lora(module) -> bool:
    """A peft LoRA linear layer whose active adapters fold into its weight exactly as its
    forward applies them: plain LoRA (no DoRA or other variant, no LoRA bias), adapters
    enabled and not already merged, over a float nn.Linear held as a plain tensor (not a
    DTensor shard, not quantized)."""
    base = getattr(module, "base_layer", None)
    if not (isinstance(base, torch.nn.Linear) and hasattr(module, "get_delta_weight")
            and hasattr(module, "lora_A")):
        return False
    if module.disable_adapters or module.merged:
        return False
    weight = base.weight
    if type(weight.data) is not torch.Tensor or not weight.is_floating_point() or \
            weight.is_meta:
        return False
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}) or module.lora_bias.get(name, False):
            return False
        if module.lora_A[name].weight.dtype != weight.dtype:
            return False
    return True


def _merged_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return F.linear(x, weight, bias)

    return forward


@contextlib.contextmanager
def merged_lora(model):
    """While inside: every foldable LoRA linear layer of `model` (`_foldable_lora`) computes
    x (W + sum over its active adapters of peft's get_delta_weight)^T + b, one GEMM. The
    parameters are not touched (the merged weight is a new tensor, freed on exit) and each
    layer's own forward is back on exit; yields how many layers were folded. No gradient."""
    folded = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if not _foldable_lora(module):
                    continue
                base = module.base_layer
                weight = base.weight.detach().clone()
                for name in module.active_adapters:
                    if name in module.lora_A:
                        weight += module.get_delta_weight(name)
                folded.append((module, module.__dict__.get("forward")))
                module.forward = _merged_forward(weight, base.bias)
        yield len(folded)
    finally:
        for module, own in folded:
            if own is None:
                del module.forward
            else:
                module.forward = own


def _compiled(model) -> bool:
    """Whether a module of `model` runs under torch.compile (regional: a compiled `forward`
    attribute; whole: an OptimizedModule): swapping a layer's forward would recompile. A
    forward under torch.compiler.disable (the chunked loss's head) is not compiled."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if type(module).__name__ == "OptimizedModule" or (
                hasattr(forward, "_torchdynamo_orig_callable")
                and not getattr(forward, "_torchdynamo_disable", False)):
            return True
    return False


def _sharded(model) -> bool:
    """Whether the model's parameters are shards (FSDP2's DTensors): no whole weight to merge
    an adapter into."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


class LocalGenerator:
    """Generation in this process with the model's current weights (see `Generator`).

    `model` is the causal LM being trained, a peft `PeftModel` (LoRA, whose forward passes the
    cache arguments through) or a plain Hugging Face model; unwrapped from DDP. It runs in eval
    mode under torch.no_grad (not inference_mode: the completions feed the training forward,
    which autograd records) and with use_cache=True whatever `model.config.use_cache` says, so
    gradient checkpointing (active in train mode only) and dropout are off; every module's
    train/eval flag is restored afterwards. The caller's torch.autocast, if any, applies to the
    forwards; scores are processed in float32 as Hugging Face generate does.

    `batch_size` rows (of B * num_generations) go through the model at a time; None: all. With
    one seed, the draws come from one generator in row order, so completions depend on the seed
    and on batch_size; with a seed per prompt, each prompt's from its own generator, so they
    do not depend on batch_size either while it is a multiple of num_generations (a chunk
    that splits a prompt's rows changes the order of their draws). `stop_check_every`: how
    often the loop checks whether every row has finished (None: every token on the CPU,
    STOP_CHECK_EVERY tokens elsewhere); it changes the work done, never the completions.
    `all_finished`: see the attribute.
    `merge_adapters`: fold LoRA adapters into their layers' weights for the call
    (`merged_lora`); None: where it keeps the arithmetic float32 and costs only host memory,
    i.e. on the CPU, with float32 weights, outside autocast, not sharded (FSDP2's DTensor
    parameters) and not compiled; True: wherever a layer allows it (also under autocast, where
    the merged weight is cast as the base weight is); False: never.
    """

    def __init__(self, model, params: SamplingParams, eos_token_ids: list[int],
                 pad_token_id: int, batch_size: int | None = None, *,
                 stop_check_every: int | None = None,
                 all_finished: Callable[[torch.Tensor], bool] | None = None,
                 merge_adapters: bool | None = None):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size!r}")
        if stop_check_every is not None and stop_check_every < 1:
            raise ValueError(f"stop_check_every must be >= 1 or None, got {stop_check_every!r}")
        self.stop_check_every = stop_check_every
        #: finished rows -> whether generation may stop: this rank's rows by default; a
        #: sharded model's strategy asks every rank (FSDP2 gathers weights inside each
        #: forward, a collective every rank must join the same number of times)
        self.all_finished = all_finished or (lambda finished: bool(finished.all()))
        self.model = model
        self.params = params
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.batch_size = batch_size
        self._logits_to_keep = _accepts_logits_to_keep(model)
        self.merge_adapters = merge_adapters

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int, seed: int | Sequence[int]) -> Completions:
        if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
            raise ValueError(f"prompt_ids and prompt_mask must both be [B, P], got "
                             f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}")
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        ids = prompt_ids.repeat_interleave(num_generations, dim=0)
        mask = prompt_mask.repeat_interleave(num_generations, dim=0)
        rows = ids.shape[0]
        spans = _draw_spans(seed, prompt_ids.shape[0], num_generations, ids.device)
        chunk = self.batch_size or rows

        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        merge = self._merging(ids.device)
        try:
            with merged_lora(self.model) if merge else contextlib.nullcontext():
                parts = [self._generate_rows(ids[i:i + chunk], mask[i:i + chunk],
                                             _in_chunk(spans, i, min(i + chunk, rows)))
                         for i in range(0, rows, chunk)]
        finally:
            for module, training in modes:
                module.training = training

        out = torch.cat([p[0] for p in parts])
        keep = torch.cat([p[1] for p in parts])
        finished = torch.cat([p[2] for p in parts])
        lengths = keep.sum(dim=1)
        width = int(lengths.max())  # the one host sync of the call, besides the chunks'
        return Completions(ids=out[:, :width].contiguous(), mask=keep[:, :width].contiguous(),
                           lengths=lengths, clipped=~finished)

    def _merging(self, device: torch.device) -> bool:
        """Whether this call folds LoRA adapters (see `merge_adapters`)."""
        if self.merge_adapters is not None:
            return self.merge_adapters and not _sharded(self.model)
        if (device.type != "cpu" or _sharded(self.model)
                or torch.is_autocast_enabled("cpu")):
            return False
        if any(p.dtype != torch.float32 for p in self.model.parameters()):
            return False
        return not _compiled(self.model)

    def _forward(self, ids, attention_mask, positions, cache):
        kwargs = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": positions,
                  "past_key_values": cache, "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        # float32 scores, as Hugging Face generate takes them; the last position only
        return out.logits[:, -1].float(), out.past_key_values

    def _generate_rows(self, ids: torch.Tensor, mask: torch.Tensor, spans: list[Span]):
        """One chunk of rows: prefill, then one cached forward per token; `spans`: which
        generator draws which of its rows (`_draw_spans`).
        -> (ids [n, T], mask [n, T], finished [n]) with T = max_completion_length."""
        params, pad, device = self.params, self.pad_token_id, ids.device
        real = mask != 0
        # Columns that are padding in every row of the chunk cost compute and change nothing:
        # drop them. Without any padding left the mask is dropped too (None), as Hugging Face
        # generate does, so attention can take its causal fast path. Two host syncs per chunk.
        start = int(real.any(dim=0).int().argmax())
        ids, real = ids[:, start:], real[:, start:]
        padded = not bool(real.all())
        n, prompt_len = ids.shape
        steps = params.max_completion_length
        # positions count real tokens only (HF generate's: mask.cumsum - 1, 0 on padding)
        positions = (real.long().cumsum(dim=-1) - 1).clamp(min=0)
        if padded:
            # the attention mask grows by one column per step; the new columns are all 1
            attention = torch.ones((n, prompt_len + steps), dtype=torch.long, device=device)
            attention[:, :prompt_len] = real.long()
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        out = torch.full((n, steps), pad, dtype=torch.long, device=device)
        keep = torch.zeros((n, steps), dtype=torch.long, device=device)
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        check_every = self.stop_check_every or (1 if device.type == "cpu" else STOP_CHECK_EVERY)

        logits, cache = self._forward(ids, attention[:, :prompt_len] if padded else None,
                                      positions, None)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = token_presence(ids, real, logits.shape[-1])
            absorb = logits.shape[-1]  # the column for ids past the output vocabulary
        next_position = positions[:, -1:] + 1
        for t in range(steps):
            scores = process_logits(logits, params, seen)
            if params.greedy or len(spans) == 1:
                tokens = next_tokens(scores, params, spans[0][2] if spans else None)
            else:
                tokens = torch.cat([next_tokens(scores[a:b], params, generator)
                                    for a, b, generator in spans])
            tokens = tokens.masked_fill(finished, pad)  # finished rows emit pad
            out[:, t] = tokens
            keep[:, t] = (~finished).long()  # the EOS itself is kept
            finished |= torch.isin(tokens, eos)
            if t + 1 == steps or ((t + 1) % check_every == 0
                                  and self.all_finished(finished)):
                break
            if seen is not None:
                seen.scatter_(1, tokens.clamp(max=absorb)[:, None], True)
            logits, cache = self._forward(
                tokens[:, None], attention[:, :prompt_len + t + 1] if padded else None,
                next_position + t, cache)
        return out, keep, finished


#: rows [start, end) of a call (or a chunk) whose tokens one generator draws, in row order
Span = tuple[int, int, torch.Generator]


def _draw_spans(seed: int | Sequence[int], prompts: int, num_generations: int,
                device: torch.device) -> list[Span]:
    """One seed: one generator draws every row. One seed per prompt: each prompt's
    num_generations rows from a generator of their own."""
    def seeded(value) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(value))
        return generator

    if not isinstance(seed, Sequence):
        return [(0, prompts * num_generations, seeded(seed))]
    if len(seed) != prompts:
        raise ValueError(f"{len(seed)} seeds for {prompts} prompts: give one seed, or one per "
                         "prompt")
    return [(i * num_generations, (i + 1) * num_generations, seeded(s))
            for i, s in enumerate(seed)]


def _in_chunk(spans: list[Span], start: int, end: int) -> list[Span]:
    """The spans of rows [start, end), counted from the chunk's first row."""
    return [(max(a, start) - start, min(b, end) - start, g) for a, b, g in spans
            if a < end and b > start]
