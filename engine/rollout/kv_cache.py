"""A key/value cache for the rollout's decode loop that is written in place, not regrown.

Hugging Face's `DynamicCache` appends each new token's keys and values with `torch.cat`, which
copies the whole cache of every layer at every token: the copies grow with the prompt plus the
completion so far, O(T^2) memory traffic over a completion of T tokens. `preallocated_cache`
gives the model the same cache interface (a `DynamicCache` whose full-attention layers are
`PreallocatedLayer`s) over buffers sized once for the prompt plus `max_completion_length`, so a
token writes one column. Attention still sees exactly the filled length (views of the buffers),
so the arithmetic, and the tokens drawn, are those of the dynamic cache: bitwise on the CPU
(tests/test_grpo_generation.py).

The shared prefill's other half is the cache's own `batch_repeat_interleave`: a prompt's
completions start from the same prefix, so the rollout prefills each prompt once and repeats its
cached keys and values for its `num_generations` rows (engine.rollout.local).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of `capacity` positions, filled from the left.

    `keys`/`values` are views of the filled part ([N, heads, length, head_dim]), which is
    what `DynamicLayer` exposes, so masks and attention see the same shapes and numbers.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, _ = key_states.shape
        self._keys = key_states.new_empty((rows, heads, self.capacity, key_states.shape[-1]))
        self._values = value_states.new_empty((rows, value_states.shape[1], self.capacity,
                                               value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the preallocated cache holds {self.capacity} positions; "
                             f"{end} were written")
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def _expose(self) -> None:
        self.keys = self._keys[:, :, :self.length]
        self.values = self._values[:, :, :self.length]

    def get_seq_length(self) -> int:
        return self.length

    # the generic layer operations (Cache.batch_repeat_interleave and batch_select_indices
    # call them per layer), kept correct for the buffers
    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` consecutive rows (the buffers' empty part included)."""
        if self.is_initialized and repeats > 1:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._expose()

    def reset(self) -> None:
        self.length = 0
        self._keys = self._values = None
        super().reset()


def preallocated_cache(config, capacity: int) -> DynamicCache | None:
    """A cache for `capacity` positions whose full-attention layers write in place; None
    where the model's config yields layers other than plain full attention (sliding windows,
    linear attention, shared KV): those keep Hugging Face's own cache."""
    if config is None:
        return None
    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config the cache cannot read: let the model build its own
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache

