"""Numerics shared by the model-family adapters and the POP engine: RoPE, RMSNorm epsilons, and the fused K/V
projection of several layers. Below both `families/` and `pop.py`, so that neither imports the other for them."""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the supported families apply it; x is (..., B, H, T, D), cos/sin are (B, T, D)."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    return x * cos + rotate_half(x) * sin


def norm_eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise TypeError(f"cannot read the epsilon of {type(norm).__name__}")


class FusedKVProjection:
    """K/V of several layers from one hidden state in a single GEMM.

    Every skipped layer normalises the same h, so 1/rms(h) is computed once and each layer's norm weight is
    folded into its W_K and W_V rows: [W_K·diag(w_l); W_V·diag(w_l)] stacked over the layers. k_norm is then a
    batched RMSNorm over the head dimension, and RoPE is applied per layer type.
    """

    def __init__(self, adapter, layer_ids: tuple[int, ...]):
        """`adapter`: a `FamilyAdapter` (its layers, input norms, k_norms, layer types and norm weight offset)."""
        self.layer_ids = layer_ids
        first = adapter.layers[layer_ids[0]].self_attn
        self.head_dim = first.head_dim
        self.num_kv_heads = first.k_proj.out_features // self.head_dim
        offset = adapter.norm_weight_offset
        eps = {norm_eps(adapter.input_norm(i)) for i in layer_ids}
        if len(eps) != 1:
            raise ValueError(f"the skipped layers' input norms disagree on epsilon ({sorted(eps)}); use fused=False")
        self.eps = eps.pop()
        rows, biases = [], []
        with torch.no_grad():
            for i in layer_ids:
                attn = adapter.layers[i].self_attn
                scale = adapter.input_norm(i).weight.float() + offset
                for proj in (attn.k_proj, attn.v_proj):
                    if hasattr(proj, "lora_A"):  # its weight alone is not what it computes
                        raise ValueError(f"layer {i}'s K/V projections carry unmerged low-rank adapters: merge them "
                                         "into the weights (pop_vlm.load does) or use fused=False")
                    rows.append((proj.weight.float() * scale[None, :]).to(proj.weight.dtype))
                    biases.append(proj.bias)
            self.weight = torch.cat(rows, dim=0).contiguous()
            self.bias = None if biases[0] is None else torch.cat(biases, dim=0).contiguous()
            k_norms = [adapter.k_norm(i) for i in layer_ids]
            if any(n is None for n in k_norms):
                self.k_norm_weight = None
            else:
                self.k_norm_weight = torch.stack([n.weight.float() + offset for n in k_norms])[:, None, :]
                self.k_norm_eps = norm_eps(k_norms[0])
        self.types = [adapter.layer_types[i] for i in layer_ids]

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, rope: dict):
        """(layer, keys, values) for each skipped layer, keys and values (B, kv_heads, T, head_dim).

        One GEMM gives every layer's K and V; k_norm and RoPE then run one layer at a time, so that only one
        layer's temporaries exist besides the GEMM's output (no extra peak memory over the full model's prefill).
        """
        batch, length, _ = hidden.shape
        h = hidden.float()
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(hidden.dtype)
        out = torch.nn.functional.linear(normed, self.weight, self.bias)
        out = out.view(batch, length, len(self.layer_ids), 2, self.num_kv_heads, self.head_dim)
        for j, layer in enumerate(self.layer_ids):
            keys, values = out[:, :, j, 0], out[:, :, j, 1]  # (B, T, H, D)
            if self.k_norm_weight is not None:
                kf = keys.float()
                keys = (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + self.k_norm_eps) * self.k_norm_weight[j]).to(hidden.dtype)
            cos, sin = rope[self.types[j]]
            yield layer, apply_rope(keys.transpose(1, 2), cos, sin), values.transpose(1, 2)
