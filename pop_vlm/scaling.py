"""Width scaling of published model configs, for benchmarks at a fraction of a model's width: hidden and MLP sizes
and head counts shrink, while layers, layer types and head_dim stay as published."""
from __future__ import annotations

import copy


def scale_width(value: int, scale: float, multiple: int = 32) -> int:
    return max(multiple, int(round(value * scale / multiple)) * multiple)


def scale_heads(heads: int, kv_heads: int, scale: float) -> tuple[int, int]:
    """Scale the head counts with the width, keeping the grouped-query ratio while at least one KV head is left."""
    group = heads // kv_heads
    scaled = max(1, int(round(heads * scale)))
    if scaled < group:  # too narrow for a whole group: one KV head shared by all query heads
        return scaled, 1
    kv = max(1, int(round(kv_heads * scale)))
    return kv * group, kv


def scale_text(cfg: dict, scale: float, vocab: int | None) -> dict:
    cfg = copy.deepcopy(cfg)
    if scale != 1.0:
        heads, kv = scale_heads(cfg["num_attention_heads"], cfg["num_key_value_heads"], scale)
        cfg["num_attention_heads"], cfg["num_key_value_heads"] = heads, kv
        cfg["hidden_size"] = scale_width(cfg["hidden_size"], scale, multiple=max(32, heads))
        cfg["intermediate_size"] = scale_width(cfg["intermediate_size"], scale)
    if vocab:
        cfg["vocab_size"] = int(vocab)
    return cfg


def scale_vision_heads(hidden: int, heads: int, scale: float) -> tuple[int, int]:
    head_dim = hidden // heads
    new_heads = max(1, int(round(heads * scale)))
    return new_heads * head_dim, new_heads
