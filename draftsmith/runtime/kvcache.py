"""A KV cache that writes each step in place instead of concatenating.

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`, which copies
the whole cache of the layer every step: at 32 rows of the embedded target (30 layers, 3 KV
heads of 64) and 115 cached positions that is 170 MB copied per decode step in float32, and it
grows with every token. `SlabLayer` keeps the keys and values in a buffer with room for
`capacity` positions and writes each step into the next free slots;
`keys` and `values` are views of the filled part, so attention reads exactly the tensors the
concatenating cache would hold (same values, same order). A layer that runs out of room
doubles its buffer (one copy); cropping keeps the buffer, and a batch selection or reset starts
a new one. benchmarks/bench_regen_batch.py measures regeneration with and without it
(benchmarks/results/regen_batch_<kind>.md: 1.15x on a range of the default in float32 with
the kernels capped at AVX2, every conversation identical).

`slab_cache(model, capacity)` is a `DynamicCache` for `model` whose full-attention layers are
`SlabLayer`s (sliding-window and other layer kinds keep transformers' own).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class SlabLayer(DynamicLayer):
    """`DynamicLayer` with a preallocated buffer: `update` writes in place, no `cat`."""

    def __init__(self, capacity: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.capacity = int(capacity)
        self.slab_keys: torch.Tensor | None = None
        self.slab_values: torch.Tensor | None = None

    def _filled(self) -> int:
        return 0 if self.keys is None or self.keys.dim() < 2 else self.keys.shape[-2]

    def _own(self) -> bool:
        """Whether `keys`/`values` are still views at the start of this layer's buffers."""
        return (
            self.slab_keys is not None
            and self.keys.data_ptr() == self.slab_keys.data_ptr()
            and self.values.data_ptr() == self.slab_values.data_ptr()
            and self.keys.shape[:-2] == self.slab_keys.shape[:-2]
        )

    def _reserve(self, key_states, value_states, need: int, room: int) -> None:
        """New buffers with room for `need` positions (at least `capacity`, at least twice the
        `room` of the full ones), holding the filled part (a copy, once)."""
        n = self._filled()
        size = max(self.capacity, need, 2 * room)
        lead = key_states.shape[:-2]
        keys = key_states.new_empty(*lead, size, key_states.shape[-1])
        values = value_states.new_empty(*lead, size, value_states.shape[-1])
        if n:
            keys[..., :n, :].copy_(self.keys)
            values[..., :n, :].copy_(self.values)
        self.slab_keys, self.slab_values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self._filled(), key_states.shape[-2]
        # no room where keys are not views of our buffers (first update, selection, reset)
        room = self.slab_keys.shape[-2] if n > 0 and self._own() else 0
        if not room or n + new > room:
            self._reserve(key_states, value_states, n + new, room)
        self.slab_keys[..., n : n + new, :].copy_(key_states)
        self.slab_values[..., n : n + new, :].copy_(value_states)
        self.keys = self.slab_keys[..., : n + new, :]
        self.values = self.slab_values[..., : n + new, :]
        return self.keys, self.values

    def reset(self) -> None:
        self.slab_keys = self.slab_values = None
        super().reset()


def slab_cache(model, capacity: int):
    """A `DynamicCache` for `model` with `SlabLayer`s of room for `capacity` positions in place
    of its full-attention `DynamicLayer`s."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.layers = [
        SlabLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
