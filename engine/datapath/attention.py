"""Variable-length attention: one row per micro-batch (padding-free) or packed rows, each
example attending only to itself, through the fastest kernel the machine has.

Padded batches spend compute on pad slots (a third of it on Alpaca at batch 8), and packed rows
behind a block-diagonal mask fall off the fast kernels. Here the example boundaries travel as
`cu_seq_lens_q/k` (cumulative lengths over the flattened tokens: transformers' varlen keyword
names, which its models pass from `forward(**kwargs)` down to the attention function) with
`max_length_q/k`, and one kernel, chosen once at start-up, computes attention for them all:

- `torch_varlen`: PyTorch's flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`), one
  call per layer over every example of the micro-batch; CUDA, bf16/fp16.
- `flash_attn`: the flash-attn package's `flash_attn_varlen_func` when it is installed; CUDA.
- `flex`: FlexAttention with a document mask (causal within each example), the portable
  GPU fallback: any dtype (fp32 included), any GPU torch compiles for; compiled once (eager
  FlexAttention materialises the scores). No attention dropout. torch has no FlexAttention
  backward on a CPU, so it cannot train there (its forward, eager and compiled, is tested on
  the CPU against separate forwards).
- `sdpa_per_example`: causal SDPA once per example (the fast unmasked kernel; cost = sum of
  squared lengths). Right on a CPU, where one call per example costs microseconds; on a GPU
  every call is a kernel launch (thousands per step), so it is the fallback there, with cuDNN
  attention kept out (it plans every new shape on the host: ~3 ms per call measured on an H100).
  On a CPU computing in bf16/fp16, a micro-batch of short examples (see `_short_on_cpu`) runs
  instead as one right-padded batch of plain matmuls with an fp32 softmax (transformers' eager
  attention, batched): torch's flash CPU kernel is slow in bf16 at these lengths. Measured on
  the 2-core EPYC with AVX512-BF16, forward and backward of 8 examples of 110-133 tokens, 9
  heads over 3 kv heads of 64: 17.9 ms per example-wise flash call set, 7.3 ms padded (and
  fp32 flash 12.4 ms); at 500 tokens flash wins (129 vs 309 ms), hence the length limit.

The flash kernels take the boundaries on the device, copied with the batch (`host_keys()`
tells the loop which keys stay behind): nothing in a layer reads the host, so compiled blocks
see no graph break and no sync. Per-example SDPA and FlexAttention's mask read them on the host. Registered with transformers' AttentionInterface under
VARLEN_ATTENTION; a batch without boundaries (padded evaluation, generation) falls through to the
stock SDPA function with the stock SDPA mask, so the model stays usable for everything else.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from engine.modeling.model import base_model

VARLEN_ATTENTION = "finetune_varlen"
_FAST_DTYPES = (torch.bfloat16, torch.float16)


class _Chosen:
    kernel = "sdpa_per_example"
    #: the flash kernel as one call (q, k, v, cu, max_len, scale, dropout) -> out, resolved
    #: once when the kernel is chosen, not in every layer's forward
    call = None
    #: (host cu tensor, device) -> its device copy, for the layers of one forward
    cached: tuple | None = None


def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _flash_attn_fn():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flex_fn():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return flex_attention


#: kernels that take any compute dtype (the flash ones need bf16/fp16)
_ANY_DTYPE = ("flex", "sdpa_per_example")


def available_kernels(device: torch.device) -> list[str]:
    """The varlen kernels this machine can train with, fastest first: on a GPU the flash
    kernels, then FlexAttention; per-example SDPA everywhere (on a CPU, where a call costs
    microseconds, the only one: FlexAttention has no CPU backward)."""
    found = []
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] >= 8:
            if _torch_varlen_fn() is not None:
                found.append("torch_varlen")
            if _flash_attn_fn() is not None:
                found.append("flash_attn")
        if _flex_fn() is not None:
            found.append("flex")
    return found + ["sdpa_per_example"]


def choose_kernel(device: torch.device, compute_dtype: torch.dtype, requested: str = "auto"
                  ) -> str:
    """`requested` if the machine has it, else (auto) the fastest one; the flash kernels need
    bf16/fp16 compute (autocast or half weights)."""
    usable = [k for k in available_kernels(device)
              if k in _ANY_DTYPE or compute_dtype in _FAST_DTYPES]
    if requested == "auto":
        return usable[0]
    if requested not in usable:
        from finetune.errors import PipelineError

        why = ("it needs bf16/fp16 compute (training.mixed_precision: bf16)"
               if requested in available_kernels(device)
               else "torch's FlexAttention has no backward on a CPU"
               if requested == "flex" and device.type == "cpu"
               else "this machine does not have it")
        raise PipelineError(f"training.varlen_kernel: {requested} cannot run here ({why}); "
                            f"usable: {', '.join(usable)} (or auto)")
    return requested


def _once_per_forward(cu: torch.Tensor, device: torch.device, build):
    """`build(cu, device)`, computed once per forward: every layer gets the same host `cu`."""
    cached = _Chosen.cached
    if cached is not None and cached[0] is cu and cached[1] == device:
        return cached[2]
    value = build(cu, device)
    _Chosen.cached = (cu, device, value)
    return value


def host_keys() -> tuple[str, ...]:
    """The batch keys the chosen kernel reads on the host (the loop copies the rest)."""
    from engine.datapath.data import BOUNDARY_KEYS

    return BOUNDARY_KEYS if _Chosen.kernel in _HOST_READERS else ()


#: kernels that slice with the boundaries as Python ints
_HOST_READERS = ("sdpa_per_example", "flex")


def _on_device(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The boundaries on the device: as they came when the loop copied them with the batch,
    else one host-to-device copy per forward (a probe's batch)."""
    if cu.device == device:
        return cu
    return _once_per_forward(cu, device, lambda c, d: c.to(device=d, dtype=torch.int32,
                                                             non_blocking=True))


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, dim) -> (batch * tokens, heads, dim)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d)


def _flash_call(kernel: str):
    """The chosen flash kernel with causal masking, in one signature."""
    if kernel == "flash_attn":
        fn = _flash_attn_fn()
        return lambda q, k, v, cu, n, scale, dropout: fn(
            q, k, v, cu, cu, n, n, dropout_p=dropout, softmax_scale=scale, causal=True)
    fn = _torch_varlen_fn()
    causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(fn).parameters
              else {"is_causal": True})  # torch >= 2.12 / older
    return lambda q, k, v, cu, n, scale, dropout: fn(q, k, v, cu, cu, n, n, scale=scale,
                                                      **causal)


def _flex_call(device: torch.device):
    """FlexAttention, compiled once on CUDA (where eager would materialise the scores);
    eager on a CPU, where it is the reference (training.torch_compile compiles it there)."""
    fn = _flex_fn()
    return torch.compile(fn, dynamic=True) if device.type == "cuda" else fn


def _varlen_kernel(query, key, value, cu, max_len: int, scaling, dropout: float):
    b, h, t, d = query.shape
    q, k, v = _flat(query), _flat(key), _flat(value)
    if q.dtype not in _FAST_DTYPES:
        # under autocast the rotary embedding hands fp32 q/k on (elementwise ops are not
        # autocast); the flash kernels take the autocast dtype, as transformers' own do
        if not torch.is_autocast_enabled(query.device.type):
            raise RuntimeError(f"{VARLEN_ATTENTION}: {_Chosen.kernel} needs bf16/fp16 inputs")
        fast = torch.get_autocast_dtype(query.device.type)
        q, k, v = q.to(fast), k.to(fast), v.to(fast)
    if k.shape[1] != h:  # grouped-query attention: repeat the kv heads
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    out = _Chosen.call(q, k, v, _on_device(cu, query.device), max_len, scaling, dropout)
    return out.view(b, t, h, d)


def _document_mask(cu: torch.Tensor, device: torch.device):
    """FlexAttention's block mask for the examples laid end to end at `cu` (causal within
    each); built once per forward and shared by every layer, like the device copy of `cu`."""
    return _once_per_forward(cu, device, _build_document_mask)


def _build_document_mask(cu: torch.Tensor, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    total = int(cu[-1])
    bounds = cu.to(device=device, dtype=torch.int64)
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=device),
                                  bounds[1:] - bounds[:-1], output_size=total)

    def same_example_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return create_block_mask(same_example_causal, None, None, total, total, device=device)


def _flex_kernel(query, key, value, cu, scaling, dropout: float):
    """(batch, heads, tokens, dim) -> (batch, tokens, heads, dim): the rows laid end to end as
    one sequence, the document mask keeping every example to itself."""
    if dropout:
        raise RuntimeError(f"{VARLEN_ATTENTION}: flex has no attention dropout (the model's "
                           f"is {dropout}); choose another training.varlen_kernel")
    b, h, t, d = query.shape
    q, k, v = (x.transpose(0, 1).reshape(1, x.shape[1], b * t, d) for x in (query, key, value))
    if torch.is_autocast_enabled(query.device.type):  # rotary hands fp32 q/k on
        fast = torch.get_autocast_dtype(query.device.type)
        q, k, v = q.to(fast), k.to(fast), v.to(fast)
    out = _Chosen.call(q, k, v, block_mask=_document_mask(cu, query.device), scale=scaling,
                       enable_gqa=k.shape[1] != h)
    return out.reshape(h, b, t, d).permute(1, 2, 0, 3)


#: the padded-matmul path's limits: its longest example (tokens; flash wins beyond about
#: 300 in bf16 on the CPU measured) and its score elements (examples x heads x longest^2, about
#: 10 bytes each kept for backward per layer: 80 MB at most)
SHORT_EXAMPLE_TOKENS = 256
SHORT_SCORE_ELEMENTS = 1 << 23


def _cpu_compute_dtype(query) -> torch.dtype:
    """What a CPU's matmuls compute in here: autocast's dtype, else the inputs'."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype


def _short_on_cpu(query, bounds: list[int]) -> int:
    """The longest example's length when this micro-batch takes the padded-matmul path (a CPU
    computing in bf16/fp16, short examples, bounded scores), else 0."""
    if query.device.type != "cpu" or _cpu_compute_dtype(query) not in _FAST_DTYPES:
        return 0
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    n = len(bounds) - 1
    fits = (longest <= SHORT_EXAMPLE_TOKENS
            and n * query.shape[1] * longest * longest <= SHORT_SCORE_ELEMENTS)
    return longest if fits else 0


def _padded_positions(cu: torch.Tensor, longest: int) -> torch.Tensor:
    """Where each flat token sits in the (examples x longest) right-padded layout; built once
    per forward and shared by every layer."""
    def build(c, device):
        bounds = c.tolist()
        return torch.cat([torch.arange(s, e) - s + i * longest
                          for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]).to(device)
    return _once_per_forward(cu, torch.device("cpu"), build)


def _padded_math(query, key, value, cu, longest: int, scaling, dropout: float):
    """(1, heads, tokens, dim) -> (1, tokens, heads, dim): the examples right-padded to
    `longest`, causal attention as two batched matmuls around an fp32 softmax. Right padding
    needs no padding mask: a real query at position i sees keys <= i, all real; the pad rows'
    outputs are dropped, so they get no gradient and give none."""
    h, kv, d = query.shape[1], key.shape[1], query.shape[3]
    n = len(cu) - 1
    low = _cpu_compute_dtype(query)
    at = _padded_positions(cu, longest)

    def pad(x):  # (1, heads, tokens, dim) -> (examples, heads, longest, dim)
        x = x[0].to(low)
        out = x.new_zeros(x.shape[0], n * longest, d).index_copy(1, at, x)
        return out.view(x.shape[0], n, longest, d).transpose(0, 1)

    with torch.autocast("cpu", enabled=False):
        # the scale on q (examples x longest x dim), not on the scores (x longest x longest)
        scale = d ** -0.5 if scaling is None else scaling
        q = pad(query * scale).view(n, kv, h // kv, longest, d)  # grouped-query: kv once
        k, v = pad(key).unsqueeze(2), pad(value).unsqueeze(2)
        # -inf above the diagonal, added: an addition's backward passes the gradient through
        # untouched (a masked_fill's would mask it again; softmax's is already 0 there)
        future = torch.full((longest, longest), float("-inf"), dtype=low).triu(1)
        probs = (q @ k.transpose(-1, -2) + future).softmax(-1, dtype=torch.float32).to(low)
        if dropout:
            probs = F.dropout(probs, dropout)
        out = (probs @ v).view(n, h, longest, d).permute(0, 2, 1, 3).reshape(n * longest, h, d)
    return out.index_select(0, at).unsqueeze(0)


def _per_example(query, key, value, cu, scaling, dropout: float):
    """(1, heads, tokens, dim) -> (1, tokens, heads, dim), causal SDPA per example (or, short
    examples on a CPU in bf16/fp16, `_padded_math`)."""
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION}: per-example attention needs one row, got "
                         f"{query.shape[0]}")
    bounds = cu.tolist()
    if longest := _short_on_cpu(query, bounds):
        return _padded_math(query, key, value, cu, longest, scaling, dropout)
    gqa = query.shape[1] != key.shape[1]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):  # never cuDNN: it plans every new shape on the host
        outs = [F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout,
            is_causal=True, scale=scaling, enable_gqa=gqa)
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def varlen_attention_forward(module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             **kwargs):
    """transformers' attention-function contract: returns ((batch, tokens, heads, dim), None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    dropout = dropout if module.training else 0.0
    if _Chosen.kernel == "sdpa_per_example":
        return _per_example(query, key, value, cu, scaling, dropout), None
    if _Chosen.kernel == "flex":
        return _flex_kernel(query, key, value, cu, scaling, dropout), None
    max_len = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
    return _varlen_kernel(query, key, value, cu, max_len, scaling, dropout), None


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_ATTENTION, sdpa_mask)


def use_varlen_attention(model, kernel: str = "sdpa_per_example") -> str | None:
    """Switch a transformers model (or a PEFT model around one) to VARLEN_ATTENTION with
    `kernel`; returns the implementation it had (to switch back), or None when it cannot."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if not hasattr(base, "set_attn_implementation") or config is None:
        return None
    if not getattr(base, "_can_set_attn_implementation", lambda: False)():
        return None
    before = config._attn_implementation
    base.set_attn_implementation(VARLEN_ATTENTION)
    _Chosen.kernel = kernel
    _Chosen.call = (None if kernel == "sdpa_per_example" else _flex_call(base.device)
                    if kernel == "flex" else _flash_call(kernel))
    return before if config._attn_implementation == VARLEN_ATTENTION else None


def restore_attention(model, implementation: str) -> None:
    base_model(model).set_attn_implementation(implementation)
