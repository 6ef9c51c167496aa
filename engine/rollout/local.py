"""Completions generated in this process from the policy's current weights (`LocalGenerator`).

`LocalGenerator` generates in this process with the model being trained (a plain Hugging Face
causal LM or a peft `PeftModel` around one), batched over every row at once with a KV cache:
one prefill forward of the prompts, each prompt once, its cached keys and values then repeated
for its num_generations rows (`share_prefill`), then one forward per new token into a cache
written in place (engine.rollout.kv_cache: no per-token copy of the whole cache) and, for
Llama-family models, computed by a lean step with the forward's arithmetic and without its
per-token glue (engine.rollout.lean_decode), each step's scores processed and drawn as Hugging
Face `generate` does (engine.rollout.sampling).

The same weights, prompts and seed give the same completions bitwise (on one device and
software stack; on CUDA as far as the model's kernels are deterministic). With one seed for the
call and unchunked, they are the tokens `model.generate(do_sample=True,
num_return_sequences=G)` draws after `torch.manual_seed(seed)` (tests/test_grpo_generation.py
and bench/grpo_generation.py check it on the CPU); generate prefills every repeated row, and a
one-row prefill can round its last float32 bits differently from a G-row one (6.7e-6 at most on
stories260K), so a near-tie could draw another token: `share_prefill=False` prefills as
generate does. With one seed per prompt, each prompt's
completions are drawn from its own generator: they do not depend on which other prompts share
the call (the forwards stay batched; only the draw's noise is one call per prompt).
Through a peft LoRA model in float32 on the CPU the adapters are folded for the call
(engine.rollout.lora_merge).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.rollout.generator import Completions, check_request
from engine.rollout.kv_cache import preallocated_cache
from engine.rollout.lean_decode import lean_decoder
from engine.rollout.lora_merge import merged_lora
from engine.rollout.sampling import SamplingParams, next_tokens, process_logits, token_presence

#: On an accelerator the decode loop asks "has every row finished?" only every this many new
#: tokens: the answer is a device-to-host copy that makes the host wait for the queued kernels,
#: and asking every token would stall the launch queue once per token. The cost is at most this
#: many extra forwards after the last row finishes (their tokens are pad, masked out). On the
#: CPU nothing is queued, so it asks every token.
STOP_CHECK_EVERY = 16


def _accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM (under a peft wrapper, if any) can return the last position's
    logits only: a prefill then never holds [N, P, V] logits."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


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


@dataclass(frozen=True)
class _ModelFacts:
    """What a generation call asks of the model's modules and parameters, gathered in one walk
    of each per call (a peft-wrapped stories260K has 424 modules: a walk of its parameters
    took 0.45 ms on the 2-core dev CPU, and the call used to make five walks)."""

    sharded: bool   # FSDP2's DTensor parameters: no whole weight to fold an adapter into
    compiled: bool  # a module under torch.compile (`_compiled`)
    float32: bool   # every parameter float32

    @classmethod
    def of(cls, model) -> _ModelFacts:
        sharded, float32 = False, True
        for p in model.parameters():
            sharded = sharded or type(p).__name__ == "DTensor"
            float32 = float32 and p.dtype == torch.float32
        return cls(sharded=sharded, compiled=_compiled(model), float32=float32)


class LocalGenerator:
    """Generation in this process with the model's current weights (a `Generator`:
    engine.rollout.generator).

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
    `share_prefill`: prefill each prompt once and repeat its cache for its completions (where
    a chunk holds whole groups); num_generations times less prefill compute and memory.
    `drop_finished`: rows that finished leave the forwards (at a stop check, once they are a
    quarter of the rows still generating); their draws still happen, so the other rows draw
    the same tokens.
    `lean_decode`: decode each token with engine.rollout.lean_decode's step where it applies
    (a Llama-family model, SDPA, the preallocated cache; not sharded or compiled): the same
    logits bitwise with less per-token overhead; False: the model's forward for every token.
    `merge_adapters`: fold LoRA adapters into their layers' weights for the call
    (engine.rollout.lora_merge.merged_lora); None: where it keeps the arithmetic float32 and costs only host memory,
    i.e. on the CPU, with float32 weights, outside autocast, not sharded (FSDP2's DTensor
    parameters) and not compiled; True: wherever a layer allows it (also under autocast, where
    the merged weight is cast as the base weight is); False: never.
    """

    def __init__(self, model, params: SamplingParams, eos_token_ids: list[int],
                 pad_token_id: int, batch_size: int | None = None, *,
                 stop_check_every: int | None = None,
                 all_finished: Callable[[torch.Tensor], bool] | None = None,
                 merge_adapters: bool | None = None, share_prefill: bool = True,
                 drop_finished: bool = True, lean_decode: bool = True):
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
        self.share_prefill = share_prefill
        self.drop_finished = drop_finished
        self.lean_decode = lean_decode

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int, seed: int | Sequence[int]) -> Completions:
        check_request(prompt_ids, prompt_mask, num_generations)
        ids = prompt_ids.repeat_interleave(num_generations, dim=0)
        mask = prompt_mask.repeat_interleave(num_generations, dim=0)
        rows = ids.shape[0]
        spans = _draw_spans(seed, prompt_ids.shape[0], num_generations, ids.device)
        chunk = self.batch_size or rows
        # a chunk of whole groups prefills each prompt once (see share_prefill)
        group = num_generations if self.share_prefill and chunk % num_generations == 0 else 1

        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        facts = _ModelFacts.of(self.model)
        merge = self._merging(ids.device, facts)
        try:
            with merged_lora(self.model) if merge else contextlib.nullcontext():
                parts = [self._generate_rows(ids[i:i + chunk], mask[i:i + chunk],
                                             _in_chunk(spans, i, min(i + chunk, rows)), group,
                                             facts)
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

    def _merging(self, device: torch.device, facts: _ModelFacts) -> bool:
        """Whether this call folds LoRA adapters (see `merge_adapters`)."""
        if self.merge_adapters is not None:
            return self.merge_adapters and not facts.sharded
        if device.type != "cpu" or facts.sharded or torch.is_autocast_enabled("cpu"):
            return False
        return facts.float32 and not facts.compiled

    def _forward(self, ids, attention_mask, positions, cache):
        kwargs = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": positions,
                  "past_key_values": cache, "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        # float32 scores, as Hugging Face generate takes them; the last position only
        return out.logits[:, -1].float(), out.past_key_values

    def _decoder(self, cache, capacity: int, facts: _ModelFacts):
        """The decode step for one new token per row: (tokens, attention, positions, cache)
        -> (float32 logits, cache); the lean step where it applies, else the model's forward."""
        lean = None
        if self.lean_decode and not facts.sharded and not facts.compiled:
            lean = lean_decoder(self.model, cache, capacity)
        if lean is None:
            return self._forward
        return lambda tokens, attention, positions, cache: (
            lean.step(tokens, attention, positions), cache)

    def _generate_rows(self, ids: torch.Tensor, mask: torch.Tensor, spans: list[Span],
                       group: int, facts: _ModelFacts):
        """One chunk of rows: prefill, then one cached forward per token; `spans`: which
        generator draws which of its rows (`_draw_spans`); `group`: how many consecutive rows
        share one prompt (each group's prompt is prefilled once and its cache repeated).
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
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        check_every = self.stop_check_every or (1 if device.type == "cpu" else STOP_CHECK_EVERY)

        cache = preallocated_cache(getattr(self.model, "config", None), prompt_len + steps)
        first = slice(None, None, group)  # one row per prompt
        logits, cache = self._forward(ids[first], attention[first, :prompt_len] if padded
                                      else None, positions[first], cache)
        if group > 1:
            logits = logits.repeat_interleave(group, dim=0)
            cache.batch_repeat_interleave(group)
        decode = self._decoder(cache, prompt_len + steps, facts)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = token_presence(ids, real, logits.shape[-1])
            absorb = logits.shape[-1]  # the column for ids past the output vocabulary
        next_position = positions[:, -1:] + 1
        #: the rows still generating, when some finished rows left the forwards (None: all);
        #: scores and draws stay full-size, so every generator draws what it would otherwise
        active = None
        for t in range(steps):
            scores = process_logits(logits, params, seen)
            tokens = next_tokens(scores, params, spans[0][2] if len(spans) == 1 else spans or None)
            tokens = tokens.masked_fill(finished, pad)  # finished rows emit pad
            out[:, t] = tokens
            finished |= torch.isin(tokens, eos)
            if t + 1 == steps:
                break
            if (t + 1) % check_every == 0:
                if self.all_finished(finished):
                    break
                active = self._leave(finished, active, cache)
            if seen is not None:
                seen.scatter_(1, tokens.clamp(max=absorb)[:, None], True)
            if active is None:
                logits, cache = decode(
                    tokens[:, None], attention[:, :prompt_len + t + 1] if padded else None,
                    next_position + t, cache)
                continue
            rows, cache = decode(
                tokens[active, None], attention[active, :prompt_len + t + 1] if padded else None,
                next_position[active] + t, cache)
            logits = rows.new_zeros((n, rows.shape[-1])).index_copy_(0, active, rows)
        # a token is kept while no EOS came before it (the EOS itself is kept; after it, pad)
        ends = torch.isin(out, eos).long()
        keep = (ends.cumsum(dim=1) - ends == 0).long()
        return out, keep, finished

    def _leave(self, finished: torch.Tensor, active: torch.Tensor | None, cache):
        """Finished rows leave the forwards (their cache rows are dropped) once they are at
        least a quarter of the rows still in them: fewer rows per forward, at the price of
        one copy of the cache and a host sync at a stop check. -> the rows that stay."""
        if not self.drop_finished:
            return active
        staying = (~finished).nonzero().squeeze(1)
        now = finished.shape[0] if active is None else active.shape[0]
        if 4 * (now - staying.shape[0]) < now:
            return active
        # the positions of the staying rows among the rows the cache holds now
        kept = staying if active is None else torch.searchsorted(active, staying)
        cache.batch_select_indices(kept)
        return staying


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


def eos_ids(tokenizer, model) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return sorted(i for i in ids if i is not None)
