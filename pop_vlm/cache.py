"""A KV cache that writes into preallocated storage instead of growing by `torch.cat`.

`DynamicCache` concatenates on every update: after a prefill, the boundary step and each decode step copy every
layer's whole cache to append one token. `PreallocatedCache` is a `DynamicCache` (same API, same sliding-window
layers) whose full-attention layers keep K/V in a buffer with spare room: an update writes the new tokens in place
and returns views of the filled part. The buffer grows (by half its size) only when the room runs out.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: spare token slots a layer's buffer gets when it is first filled (the boundary step and the first decode steps)
RESERVE_TOKENS = 256


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views into a buffer with spare room along the sequence axis."""

    def __init__(self, reserve: int = RESERVE_TOKENS):
        super().__init__()
        self.reserve = reserve
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _ours(self, used: int, key_states: torch.Tensor) -> bool:
        """Whether self.keys/values are still the head of our buffers (crop keeps them; reorder/select do not)."""
        buf = self._key_buffer
        if buf is None or buf.shape[:2] != key_states.shape[:2] or buf.shape[-1] != key_states.shape[-1]:
            return False
        if buf.dtype != key_states.dtype or buf.device != key_states.device:
            return False
        return used == 0 or (self.keys.data_ptr() == buf.data_ptr() and self.values.data_ptr() == self._value_buffer.data_ptr()
                             and self.keys.stride() == buf.stride())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.get_seq_length()
        end = used + key_states.shape[-2]
        if not self._ours(used, key_states) or end > self._key_buffer.shape[-2]:
            room = self.reserve if used == 0 else max(self.reserve, end // 2)
            batch, heads, _, dim = key_states.shape
            keys = key_states.new_empty((batch, heads, end + room, dim))
            values = value_states.new_empty((batch, value_states.shape[1], end + room, value_states.shape[-1]))
            if used:
                keys[..., :used, :].copy_(self.keys)
                values[..., :used, :].copy_(self.values)
            self._key_buffer, self._value_buffer = keys, values
        self._key_buffer[..., used:end, :].copy_(key_states)
        self._value_buffer[..., used:end, :].copy_(value_states)
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None


class PreallocatedCache(DynamicCache):
    """`DynamicCache(config=...)` with `PreallocatedLayer` for its growing (non-sliding) layers."""

    def __init__(self, config=None, reserve: int = RESERVE_TOKENS, **kwargs):
        super().__init__(config=config, **kwargs)
        self.layers = [PreallocatedLayer(reserve) if type(layer) is DynamicLayer else layer for layer in self.layers]
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:
            self.layer_class_to_replicate = lambda: PreallocatedLayer(reserve)
