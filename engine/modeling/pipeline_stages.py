"""Cutting a decoder-only LM into pipeline stages (model code apart from the parallelism).

A stage is a contiguous range of decoder layers; the first stage also embeds the tokens, the
last one applies the final norm (the output layer runs in the loss, engine.strategies.pipeline,
so the full logits are never materialised at once). Ranges are balanced by parameter count,
embedding and head included, unless `distributed.pipeline.model_splitter` names a function
that returns the spans (checked: contiguous, all layers, one per stage). This rank keeps only
its stages' modules: the others are removed from the model in place, so the model's own state
dict (the names DCP checkpoints use, the names the exported HF/PEFT folder needs) is exactly
this rank's share, under the original names.

Works for the Llama family's layout (`model.embed_tokens`, `model.layers`, `model.norm`,
`model.rotary_emb`, `lm_head`: Llama, Mistral, Qwen2/3, Phi-3, ...); another layout is refused
with one line.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.modeling.model import base_model
from finetune.errors import PipelineError

PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def decoder_of(model) -> tuple[nn.Module, nn.Module]:
    """(the causal LM, its decoder) inside a PEFT wrapper, or one line saying why not."""
    lm = base_model(model)
    inner = getattr(lm, "model", None)
    if inner is None or not all(hasattr(inner, p) for p in PARTS) or not hasattr(lm, "lm_head"):
        raise PipelineError(
            f"distributed.strategy pipeline: {type(lm).__name__} does not have the decoder "
            "layout the stages are cut from (model.embed_tokens, model.layers, model.norm, "
            "model.rotary_emb, lm_head: the Llama family); use ddp or fsdp2 for this model")
    return lm, inner


def _size(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def balance(layer_sizes: list[int], first_extra: int, last_extra: int,
            stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the largest stage's parameter
    count (the first stage carries `first_extra`, the last `last_extra`). Exact (dynamic
    programming over split points); every stage gets at least one layer."""
    n = len(layer_sizes)
    if stages > n:
        raise PipelineError(f"distributed.pipeline: {stages} stages but the model has {n} "
                            "decoder layers; lower stages_per_rank or the number of processes")
    prefix = [0]
    for size in layer_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, start: int, end: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][j]: the smallest possible largest stage when stages 0..s-1 cover layers [0, j)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    ranges, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def stage_ids(rank: int, world: int, per_rank: int, style: str) -> list[int]:
    """The stages rank `rank` holds: loop r, r + W, ...; v (2 per rank) r and 2W - 1 - r."""
    if style == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(per_rank)]


class Stage(nn.Module):
    """One stage's forward: tokens or hidden states in, hidden states out."""

    def __init__(self, inner: nn.Module, layers: list[nn.Module], first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(layers)
        self.norm = inner.norm if last else None
        self.rotary_emb = inner.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            # no mask: causal attention (right padding never reaches a real token's output)
            hidden = layer(hidden, attention_mask=None, position_ids=positions,
                           position_embeddings=rotary)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.norm(hidden) if self.last else hidden


SPLITTER = "distributed.pipeline.model_splitter"


def check_spans(spans, layers: int, stages: int, ref: str) -> list[range]:
    """A model_splitter's answer as layer ranges, or one line saying what is wrong with it:
    `stages` (start, end) spans, end exclusive, contiguous from layer 0 to the last, none
    empty."""
    def wrong(why: str) -> PipelineError:
        return PipelineError(
            f"{SPLITTER}: '{ref}' returned {spans!r}: {why}; it must return {stages} (start, "
            f"end) layer spans, end exclusive, that cover layers 0-{layers - 1} in order")

    try:
        ranges = [r if isinstance(r, range) else range(*r) for r in spans]
    except TypeError:
        raise wrong("not a list of (start, end) pairs") from None
    if len(ranges) != stages:
        raise wrong(f"{len(ranges)} spans for {stages} stages")
    end = 0
    for r in ranges:
        if r.step != 1 or r.stop <= r.start:
            raise wrong(f"span {r.start}-{r.stop} is empty")
        if r.start != end:
            raise wrong(f"span {r.start}-{r.stop} does not start where the last one ended "
                        f"({end})")
        end = r.stop
    if end != layers:
        raise wrong(f"they end at layer {end}, the model has {layers}")
    return ranges


def split_layout(lm, inner, ranges: list[range]) -> list[str]:
    """Each stage's parts and parameter count (trainable too), for debug_split_model."""
    lines = []
    for s, r in enumerate(ranges):
        parts = [inner.embed_tokens] if s == 0 else []
        parts += [inner.layers[i] for i in r]
        parts += [inner.norm, lm.lm_head] if s == len(ranges) - 1 else []
        params = {id(p): p for m in parts for p in m.parameters()}.values()  # tied: once
        names = ((["embed_tokens"] if s == 0 else []) + [f"layers {r.start}-{r.stop - 1}"]
                 + (["norm", "lm_head"] if s == len(ranges) - 1 else []))
        lines.append(f"stage {s}: {', '.join(names)}: {sum(p.numel() for p in params):,} "
                     f"parameters ({sum(p.numel() for p in params if p.requires_grad):,} "
                     "trainable)")
    return lines


def cut_stages(model, ids: list[int], num_stages: int, splitter: str | None = None,
               ) -> tuple[list[Stage], list[range], list[str]]:
    """This rank's stages (in `ids` order), every stage's layer range and their layout (one
    line each); the rest of the model is removed in place (its names stay the original
    ones). `splitter`: a 'module:function' called with (the causal LM, the number of stages)
    that returns the stages' layer spans (check_spans), instead of the balance by size."""
    lm, inner = decoder_of(model)
    head = getattr(lm.lm_head, "weight", None)
    if head is not None and head is getattr(inner.embed_tokens, "weight", None) and (
            head.requires_grad):
        raise PipelineError(
            "distributed.strategy pipeline: the model ties its input embedding to its output "
            "layer and trains them, but they sit on the first and the last stage; freeze them "
            "(LoRA without embedding modules_to_save) or use ddp / fsdp2")
    tokens = getattr(lm.lm_head, "token_adapter", None)
    if tokens is not None and tokens.tied_adapter is not None:
        raise PipelineError(
            "distributed.strategy pipeline: the model ties its input embedding to its output "
            "layer and peft.trainable_token_indices trains rows of both, which sit on the "
            "first and the last stage; add no tokens, or use ddp / fsdp2")
    layers = list(inner.layers)
    if splitter:
        from finetune.imports import load_object

        ranges = check_spans(load_object(splitter, SPLITTER)(lm, num_stages), len(layers),
                             num_stages, splitter)
    else:
        ranges = balance([_size(layer) for layer in layers], _size(inner.embed_tokens),
                         _size(inner.norm) + _size(lm.lm_head), num_stages)
    layout = split_layout(lm, inner, ranges)
    stages = [Stage(inner, [layers[i] for i in ranges[s]], s == 0, s == num_stages - 1)
              for s in ids]
    kept = {i for s in ids for i in ranges[s]}
    # a ModuleDict keyed by the original index keeps `model.layers.<i>.` names
    inner.layers = nn.ModuleDict({str(i): layers[i] for i in sorted(kept)})
    if 0 not in ids:
        inner.embed_tokens = None
    if num_stages - 1 not in ids:
        inner.norm = None
        lm.lm_head = None
    return stages, ranges, layout
