"""Many sequences' K/V in one set of buffers, and the decode step that advances them together.

Each sequence owns a row (a slot) of every layer's buffer, and each row keeps its own length per layer: rows are
ragged, and a sequence joins or leaves without touching the others. Padding and a left-aligned batch would do the
same, but every join would then shift or re-pad the running rows; with per-row lengths a join is one copy of the
new sequence's cache into a free slot, a leave is one copy out, and nothing else moves.

A decode step runs one token for every row in [0, width): rows that have no token this step are carried along
as dummies (their write lands one past their length, where their next real token overwrites it, and their
logits are dropped), so that a step never gathers rows into a new tensor. Each row attends to its own keys
through a per-row mask; sliding-window layers (Gemma-3) mask everything older than the window, per row.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import DynamicCache

from .cache import PreallocatedCache
from .families.base import SLIDING, FamilyAdapter


class SlotCache:
    """K/V buffers of `slots` sequences for every decoder layer, each row with its own length per layer.

    The decoder layers call `update` as they would on a `DynamicCache`: it writes each row's new key at that row's
    length and returns the buffers up to the longest row."""

    def __init__(self, adapter: FamilyAdapter, slots: int, capacity: int = 256):
        if slots < 1:
            raise ValueError(f"a slot cache needs at least one slot, got {slots}")
        self.adapter = adapter
        self.slots = slots
        self.capacity = capacity
        config = adapter.config
        self.heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(adapter.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._allocate(capacity)
        self.lengths = torch.zeros(adapter.num_layers, slots, dtype=torch.long)  # host-side: masks read it
        self.in_use = [False] * slots
        sliding = getattr(config, "sliding_window", None)
        self.windows = [sliding if t == SLIDING else None for t in adapter.layer_types]
        self._span = 1  # key positions the current step's attention reads

    # ---- storage ----------------------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        shape = (self.slots, self.heads, capacity, self.head_dim)
        new_keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.adapter.num_layers)]
        new_values = [torch.zeros_like(k) for k in new_keys]
        for old, new in zip(self.keys + self.values, new_keys + new_values):
            new[:, :, : old.shape[2]].copy_(old)
        self.keys, self.values, self.capacity = new_keys, new_values, capacity

    def ensure_capacity(self, tokens: int) -> None:
        """Room for `tokens` positions per row; grows by half at least, so growth is rare."""
        if tokens > self.capacity:
            self._allocate(max(tokens, self.capacity + self.capacity // 2))

    @property
    def width(self) -> int:
        """Rows a step runs: up to the highest slot in use."""
        return max((i + 1 for i, used in enumerate(self.in_use) if used), default=0)

    @property
    def rows_in_use(self) -> int:
        return sum(self.in_use)

    def free_slot(self) -> int | None:
        return next((i for i, used in enumerate(self.in_use) if not used), None)

    # ---- joining and leaving ------------------------------------------------------------------------------------
    def join(self, cache: DynamicCache) -> int:
        """Copy a sequence's cache (batch 1) into a free slot; returns the slot."""
        slot = self.free_slot()
        if slot is None:
            raise RuntimeError("no free slot in the batch")
        filled = [_layer_kv(cache, i) for i in range(self.adapter.num_layers)]
        self.ensure_capacity(max((k.shape[-2] for k, _ in filled if k is not None), default=0) + 1)
        for i, (keys, values) in enumerate(filled):
            n = 0 if keys is None else keys.shape[-2]
            if n:
                self.keys[i][slot, :, :n].copy_(keys[0])
                self.values[i][slot, :, :n].copy_(values[0])
            self.lengths[i, slot] = n
        self.in_use[slot] = True
        return slot

    def leave(self, slot: int) -> PreallocatedCache:
        """Free the slot; returns its K/V as a cache of its own (a follow-up question continues from it)."""
        cache = PreallocatedCache(config=self.adapter.config)
        for i in range(self.adapter.num_layers):
            n = int(self.lengths[i, slot])
            if n:
                cache.update(self.keys[i][slot: slot + 1, :, :n].clone(), self.values[i][slot: slot + 1, :, :n].clone(), i)
        self.lengths[:, slot] = 0
        self.in_use[slot] = False
        return cache

    # ---- what the decoder layers call ---------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        width = key_states.shape[0]
        rows = torch.arange(width, device=self.device)
        at = self.lengths[layer_idx, :width].to(self.device)
        self.keys[layer_idx][rows, :, at] = key_states[:, :, -1]
        self.values[layer_idx][rows, :, at] = value_states[:, :, -1]
        return self.keys[layer_idx][:width, :, : self._span], self.values[layer_idx][:width, :, : self._span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths[layer_idx].max())

    def _masks(self, width: int, layer_ids, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """Each layer's (width, 1, 1, span) mask: a row sees its own keys up to the new one (within the window)."""
        positions = torch.arange(self._span)
        eager = self.adapter.config._attn_implementation == "eager"
        out, built = {}, {}
        for i in layer_ids:
            key = (self.windows[i], tuple(self.lengths[i, :width].tolist()))
            if key not in built:
                last = self.lengths[i, :width, None]
                allowed = positions[None] <= last
                if self.windows[i] is not None:
                    allowed &= positions[None] > last - self.windows[i]
                mask = allowed[:, None, None].to(self.device)
                if eager:  # eager attention adds its mask to the scores
                    mask = torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(~mask, torch.finfo(dtype).min)
                built[key] = mask
            out[i] = built[key]
        return out

    # ---- the batched decode step -------------------------------------------------------------------------------
    def step(self, tokens: dict[int, int], positions: dict[int, torch.Tensor], layer_ids) -> torch.Tensor:
        """One decode step: `tokens[slot]` at `positions[slot]` for the slots that have a token, through
        `layer_ids`; returns logits (width, vocab) — rows of slots without a token are meaningless."""
        if not tokens:
            raise ValueError("a step needs at least one row")
        adapter, width = self.adapter, self.width
        layer_ids = list(layer_ids)
        self.ensure_capacity(int(self.lengths[:, :width].max()) + 1)
        self._span = int(self.lengths[layer_ids, :width].max()) + 1
        ids = torch.zeros((width, 1), dtype=torch.long)
        for slot, token in tokens.items():
            ids[slot, 0] = token
        template = next(iter(positions.values()))
        batch_dim = template.ndim - 2  # (B, 1) for 1-D positions, (3, B, 1) for M-RoPE
        rows = [positions.get(slot, template) for slot in range(width)]
        hidden = adapter.embed_tokens(ids.to(self.device))
        rope = adapter.rotary(hidden, torch.cat(rows, dim=batch_dim))
        masks = self._masks(width, layer_ids, hidden.dtype)
        with _per_row_mask_attention(adapter.config):
            for i in layer_ids:
                hidden = adapter.layers[i](hidden, attention_mask=masks[i], position_ids=None, cache=self,
                                           position_embeddings=rope[adapter.layer_types[i]])
                hidden = adapter.after_layer(i, hidden, None, None)
        logits = adapter.logits(hidden)[:, -1]
        stepped = torch.tensor(sorted(tokens))
        for i in layer_ids:
            self.lengths[i, stepped] += 1
        return logits


@contextmanager
def _per_row_mask_attention(config):
    """Flash-attention's kernels take no per-row mask in this call: a batched step runs on SDPA instead (prefill,
    one sequence at a time, keeps flash-attention)."""
    implementation = config._attn_implementation
    if implementation in ("sdpa", "eager"):
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = implementation


def _layer_kv(cache: DynamicCache, index: int):
    """(keys, values) of a cache's layer, or (None, None) when it holds nothing."""
    if index >= len(cache.layers):
        return None, None
    layer = cache.layers[index]
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True) or keys.numel() == 0:
        return None, None
    return keys, layer.values
