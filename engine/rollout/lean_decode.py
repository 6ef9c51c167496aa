"""One decode step of a Llama-family model without its Hugging Face forward's per-token glue.

Where the rollout's decode time goes on the CPU (stories260K, 16 rows, one new token each): of
~3.4 ms a step through the model's forward, ~1.2 ms is neither a matmul nor attention but the
forward's generic machinery, paid per layer and per token: the attention interface's dispatch
and its per-call checks, the cache's generic update, the rotary cos/sin recomputed for every
token, the causal mask rebuilt, keyword plumbing and output dataclasses. On an accelerator the
same glue is kernel launches and host work between them.

`LeanDecoder` runs one token through the same modules (the embedding, every norm, the q/k/v/o
projections and the MLP are called, so peft LoRA layers, folded or not, biases and quantized
linears behave as in the forward) and the same arithmetic in the same order: rotary as
`apply_rotary_pos_emb` with cos/sin looked up in a table computed once per call (elementwise
functions of the position, so the same bits), keys and values written straight into the
preallocated cache (engine.rollout.kv_cache), scaled dot-product attention called as
transformers' `sdpa_attention_forward` calls it for one query (grouped-query heads through
`enable_gqa` without a mask, packed per key/value head with one), the residuals, the final norm
and the head on the last position. The logits are bitwise the model forward's
(tests/test_grpo_generation.py), so the completions are too; ~1.5x less time per decode step on
stories260K on the CPU (bench/grpo_generation.py).

What is left per token is mostly the dispatch of small operations, so the step also spends
fewer of them where the bits allow: the hidden states are [n, hidden] and each linear layer
one `mm`/`addmm` (what F.linear runs for them); rotate_half(x) * sin as x.roll(half) times a
sin table with its first half negated (negation is exact); the boolean padding mask turned into
SDPA's additive one once per token, not once per layer inside SDPA; float32 RMS norms without
their no-op casts and with eps as a float32 tensor made once. Together ~14% less generation
time in bench/grpo_vs_trl.py's setting (stories260K, 2 prompts x 8 completions x 128 tokens,
LoRA folded, 2-core Xeon, 2026-11-30), the same tokens.

It applies only where those steps are the model's own (`lean_decoder` says None otherwise and the
generator calls the model): the Llama, Mistral and Qwen2 causal LMs (one layer structure:
pre-norm attention and a gated MLP, rotate-half rotary, no q/k norms, no logit scaling), SDPA
attention, a rotary whose table does not depend on the sequence length, and a cache of
full-attention layers written in place. Sharded (FSDP2) or compiled models keep the forward: their
wrappers hook the layer forwards this skips.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _has_any_global_hook

from engine.rollout.kv_cache import PreallocatedLayer

#: causal LMs whose forward for one new token is exactly what `LeanDecoder.step` computes
LAYOUTS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
#: rotary types whose cos/sin at a position do not depend on the other positions of the call
#: (a "dynamic" or "longrope" rotary rescales with the sequence length)
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def _unwrapped(model):
    """The transformers model under a peft wrapper, if any."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lean_decoder(model, cache, capacity: int) -> LeanDecoder | None:
    """A `LeanDecoder` for `model` decoding into `cache` (up to `capacity` positions), or None
    where its forward is not the one the lean step reproduces (see the module docstring)."""
    if not lean_layout(model):
        return None
    causal = _unwrapped(model)
    if cache is None or len(cache.layers) != len(causal.model.layers) or any(
            type(layer) is not PreallocatedLayer for layer in cache.layers):
        return None
    return LeanDecoder(causal, cache, capacity)


def lean_layout(model) -> bool:
    """Whether `model`'s one-token forward is the one `LeanDecoder.step` reproduces (given a
    preallocated cache): a Llama, Mistral or Qwen2 causal LM with SDPA attention, a static
    rotary and only full-attention layers."""
    causal = _unwrapped(model)
    if type(causal).__name__ not in LAYOUTS:
        return False
    config, body = causal.config, getattr(causal, "model", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or body is None:
        return False
    if getattr(body.rotary_emb, "rope_type", "default") not in STATIC_ROPE:
        return False
    return not (getattr(config, "layer_types", None)
                and any(t != "full_attention" for t in config.layer_types))


class LeanDecoder:
    """`step(tokens, attention, positions)`: the next-token logits of `tokens` ([n, 1]) as the
    model's forward gives them with `past_key_values=cache`, whose layers it fills in place.

    Built per generation call: each module is resolved once to what its call runs (`_direct`),
    so a step pays no attribute lookups and no `nn.Module.__call__` where nothing hooks it."""

    def __init__(self, causal, cache, capacity: int):
        body = causal.model
        self.embed, self.norm = _direct(body.embed_tokens), _norm(body.norm)
        self.head = _direct(causal.lm_head)
        self.layers = [_Layer(layer, kv) for layer, kv in zip(body.layers, cache.layers)]
        # cos/sin for every position of the call, in the dtype the forward would get them in
        probe = body.embed_tokens.weight.new_zeros(1)
        positions = torch.arange(capacity, device=probe.device)[None]
        cos, sin = body.rotary_emb(probe, positions)
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == x.roll(half) * signed_sin bitwise: (-x2) * s1 == x2 * (-s1),
        # negation being exact; one roll instead of two slices, a negation and a cat
        self.cos, self.signed_sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, attention: torch.Tensor | None,
             positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: [n, 1]; attention: [n, cache length + 1] (1 attend, 0 padding) or
        None (no padding) -> float32 logits [n, vocab] of the new position.

        The hidden states are [n, hidden] (the one position's axis dropped): every linear is
        then one matrix product without matmul's folding of a 3-d input, the same product."""
        hidden = self.embed(tokens).view(tokens.shape[0], -1)
        # the rotary module's cos/sin for `positions`, shaped [n, 1, 1, head_dim] as
        # apply_rotary_pos_emb unsqueezes them
        cos = self.cos[positions].unsqueeze(1)
        sin = self.signed_sin[positions].unsqueeze(1)
        mask = None if attention is None else attention.bool()[:, None, None, :]
        for layer in self.layers:
            hidden, mask = layer(hidden, cos, sin, mask)
        return self.head(self.norm(hidden)).float()


class _Layer:
    """One decoder layer's step for one new token: its forward's arithmetic, in its order."""

    def __init__(self, layer, kv: PreallocatedLayer):
        attn = layer.self_attn
        self.norm1 = _norm(layer.input_layernorm)
        self.norm2 = _norm(layer.post_attention_layernorm)
        self.q, self.k, self.v, self.o = (_direct(attn.q_proj), _direct(attn.k_proj),
                                          _direct(attn.v_proj), _direct(attn.o_proj))
        self.mlp = _mlp(layer.mlp)
        self.kv = kv
        self.head_dim, self.groups, self.scaling = (attn.head_dim, attn.num_key_value_groups,
                                                    attn.scaling)

    def __call__(self, hidden, cos, sin, mask):
        """-> (hidden, mask): the mask as attention used it, for the next layer."""
        attended, mask = self.attention(self.norm1(hidden), cos, sin, mask)
        hidden = hidden + attended
        return hidden + self.mlp(self.norm2(hidden)), mask

    def attention(self, hidden, cos, sin, mask):
        n, head_dim, groups = hidden.shape[0], self.head_dim, self.groups
        shape = (n, -1, 1, head_dim)  # [n, heads, 1 position, head_dim]
        query, key = self.q(hidden).view(shape), self.k(hidden).view(shape)
        value = self.v(hidden).view(shape)
        half = head_dim // 2
        query = query * cos + query.roll(half, -1) * sin  # sin: the signed table (see step)
        key = key * cos + key.roll(half, -1) * sin
        key, value = self.kv.update(key, value)
        if groups > 1 and mask is None and key.shape[-1] == value.shape[-1] <= 256:
            out = F.scaled_dot_product_attention(query, key, value, scale=self.scaling,
                                                 enable_gqa=True)
        else:
            if groups > 1:  # one query: each key/value head's query heads as its rows
                query = query.reshape(n, query.shape[1] // groups, groups, head_dim)
            if mask is not None and mask.dtype == torch.bool:
                # the additive mask SDPA would make of the boolean one at every call (0 where
                # attended, -inf elsewhere, in the query's dtype), made once for all layers
                mask = torch.where(mask, 0.0, torch.tensor(-float("inf"), dtype=query.dtype,
                                                           device=mask.device))
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                 scale=self.scaling)
        # [n, heads, 1, d] (or its packed [n, kv heads, groups, d]) in [n, heads * d]'s order:
        # the forward's transpose and reshapes move no number
        return self.o(out.reshape(n, -1)), mask


def _direct(module):
    """What calling `module` on the step's 2-d hidden states runs, without `nn.Module.__call__`'s
    dispatch: its forward where no hook (its own or a global one) would run around it; for a
    linear layer (a plain nn.Linear, or a layer whose forward says it is one linear map through
    a `linear` attribute, as a folded LoRA layer's does: engine.rollout.lora_merge), the matrix
    product F.linear runs for a 2-d input (addmm with a bias, mm without) over the weight's
    transpose taken once; the module itself otherwise."""
    if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
            or module._backward_pre_hooks or _has_any_global_hook()):
        return module
    if type(module) is nn.Linear and "forward" not in module.__dict__:
        return _linear(module.weight, module.bias)
    forward = module.forward
    if getattr(forward, "linear", None) is not None:
        return _linear(*forward.linear)
    return forward


def _linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """x [n, in] -> F.linear(x, weight, bias) by the call F.linear makes for a 2-d x."""
    transposed = weight.t()
    if bias is None:
        return lambda x: torch.mm(x, transposed)
    return lambda x: torch.addmm(bias, x, transposed)


#: gated MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x))
GATED_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP"}


def _mlp(mlp):
    """The layer's MLP as its forward computes it, over its resolved projections."""
    if type(mlp).__name__ not in GATED_MLPS or _direct(mlp) is mlp:
        return mlp
    gate, up, down, act = (_direct(mlp.gate_proj), _direct(mlp.up_proj), _direct(mlp.down_proj),
                           _direct(mlp.act_fn))
    return lambda x: down(act(gate(x)) * up(x))


#: RMS norms whose forward is weight * (x * rsqrt(mean(x^2) + eps)) computed in float32
RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}


def _norm(module):
    """The norm's forward; for a known RMS norm, the same operations without its casts to and
    from float32 when the input is float32 already (two calls a norm, eleven norms a token
    on a five-layer model)."""
    forward = _direct(module)
    if type(module).__name__ not in RMS_NORMS or forward is module:
        return forward
    weight = module.weight
    # eps as the float32 the forward's Python float becomes inside the add, made once
    eps = torch.tensor(module.variance_epsilon, dtype=torch.float32, device=weight.device)

    def rms_norm(x):
        if x.dtype is not torch.float32:
            return forward(x)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return rms_norm
