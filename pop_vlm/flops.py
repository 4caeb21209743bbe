"""Prefill FLOPs of each mode, counted from a model config: the speedup limit of POP and static pruning.

Counted: every matrix multiply of the decoder (Q, K, V, O projections, the gated MLP's three matrices, the LM head
on the one position that is sampled) and attention's two matmuls (QK^T and AV) over the keys each query sees —
causal, and at most `sliding_window` keys on sliding-window layers. Not counted: norms, RoPE, activations,
residual adds, softmax (element-wise work, linear in the tokens and identical per layer in every mode) and the
vision encoder (the same in every mode). One multiply-add is 2 FLOPs.

    full   : L layers over N tokens
    pop    : L-k layers over N tokens + the K/V projections of the k skipped layers over N-1 tokens
             + the last token (the boundary step) through the k skipped layers, attending to N keys
    static : L-k layers over N tokens
"""
from __future__ import annotations

from dataclasses import dataclass

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config) -> "DecoderShape":
        """From a Hugging Face config (a VLM's text config is found) or a plain dict of config.json values."""
        if not isinstance(config, dict):
            config = getattr(config, "text_config", config)
            get = lambda key, default=None: getattr(config, key, default)  # noqa: E731
        else:
            config = config.get("text_config", config)
            get = config.get
        layers = int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim") or int(get("hidden_size")) // heads
        types = get("layer_types")
        if not types and get("sliding_window_pattern"):
            pattern = int(get("sliding_window_pattern"))
            types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]
        types = tuple(types) if types else ("full_attention",) * layers
        window = get("sliding_window") if SLIDING in types else None
        return cls(layers, int(get("hidden_size")), int(get("intermediate_size")), heads,
                   int(get("num_key_value_heads") or heads), int(head_dim), int(get("vocab_size")), types,
                   int(window) if window else None)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- per token ------------------------------------------------------------------------------------------
    def linear_per_token(self) -> int:
        """Projections and MLP of one layer for one token."""
        h = self.hidden
        return 2 * (h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * self.intermediate)

    def kv_projection_per_token(self) -> int:
        """POP's K/V projection of one skipped layer for one token."""
        return 2 * 2 * self.hidden * self.kv_dim

    def lm_head(self) -> int:
        return 2 * self.hidden * self.vocab

    def keys_seen(self, layer: int, start: int, end: int) -> int:
        """Sum over queries at positions [start, end) of the number of keys each attends to (causal)."""
        total = (end * (end + 1) - start * (start + 1)) // 2  # sum of (i + 1) for i in [start, end)
        window = self.sliding_window if self.layer_types[layer] == SLIDING else None
        if window and end > window:
            first = max(start, window)  # queries from here on see exactly `window` keys
            over = sum_range(first, end) + (end - first) - window * (end - first)
            total -= over
        return total

    def attention(self, layer: int, start: int, end: int) -> int:
        """QK^T and AV of layer `layer` for queries [start, end)."""
        return 4 * self.q_dim * self.keys_seen(layer, start, end)

    def layers_over(self, layers, start: int, end: int) -> int:
        return sum((end - start) * self.linear_per_token() + self.attention(i, start, end) for i in layers)


def sum_range(start: int, end: int) -> int:
    """start + (start + 1) + ... + (end - 1)."""
    return (end * (end - 1) - start * (start - 1)) // 2 if end > start else 0


def prefill_flops(shape: DecoderShape, n_tokens: int, mode: str = "full", k: int = 0,
                  kv_projection: bool = True, boundary: bool = True) -> int:
    """FLOPs from the embedded prompt of `n_tokens` tokens to the first token's logits."""
    n, every = int(n_tokens), range(shape.num_layers)
    kept = range(shape.num_layers - k)
    if mode == "full" or k == 0:
        return shape.layers_over(every, 0, n) + shape.lm_head()
    if mode == "static":
        return shape.layers_over(kept, 0, n) + shape.lm_head()
    if mode != "pop":
        raise ValueError(f"unknown mode {mode!r}")
    if not boundary:
        flops = shape.layers_over(kept, 0, n)
        return flops + (k * n * shape.kv_projection_per_token() if kv_projection else 0) + shape.lm_head()
    flops = shape.layers_over(kept, 0, n)  # the boundary token's pass through the kept layers rides along
    skipped = range(shape.num_layers - k, shape.num_layers)
    if kv_projection:
        flops += k * (n - 1) * shape.kv_projection_per_token()
        flops += shape.layers_over(skipped, n - 1, n)
    else:  # skipped layers hold no prompt keys: the boundary token attends to itself only there
        flops += k * (shape.linear_per_token() + 4 * shape.q_dim)
    return flops + shape.lm_head()


def flop_limit(shape: DecoderShape, n_tokens: int, mode: str, k: int) -> float:
    """The speedup of `mode` over full if time were proportional to FLOPs."""
    if mode == "full":
        return 1.0
    return prefill_flops(shape, n_tokens, "full") / prefill_flops(shape, n_tokens, mode, k)
