"""How a request is run: the mode and the POP settings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

MODES = ("full", "pop", "static")

PruneSpec = Union[int, float, str]


@dataclass(frozen=True)
class PopConfig:
    """Settings of Prefill-Only Pruning.

    prune_layers: how many of the deepest decoder layers the prefill skips — an int k, a fraction of the
        layer count L (0 < f < 1, rounded to the nearest layer), or ``"auto"`` (chosen from the model's
        prefill-importance profile).
    kv_projection: fill the skipped layers' KV caches by projecting the last kept layer's output through
        each skipped layer's own input norm, W_K (and k_norm, RoPE) and W_V. ``False`` is the paper's
        ablation: skipped layers then see no prompt keys at all during decode.
    boundary: run the prompt's last token through all layers as the first decode step, so the first
        generated token comes from the full model. ``False`` takes it from the pruned stack (ablation).
    fused: compute the KV projections of all skipped layers as one GEMM (``False``: one layer at a time,
        the reference path).
    full_tail: how much of the prompt's end runs through the full model: an int M (the last M tokens; 1 is the
        paper's boundary token), or ``"text"`` — every token after the last image token (for a prompt without
        an image, the last token). The rest of the prompt runs pruned.
    """

    prune_layers: PruneSpec = 1 / 3
    kv_projection: bool = True
    boundary: bool = True
    fused: bool = True
    full_tail: Union[int, str] = 1

    def __post_init__(self):
        check_full_tail(self.full_tail)

    def num_pruned(self, num_layers: int, auto_k: int | None = None) -> int:
        """Resolve `prune_layers` to a layer count k for a model of `num_layers` layers."""
        spec = self.prune_layers
        if isinstance(spec, str):
            if spec != "auto":
                raise ValueError(f"prune_layers must be an int, a fraction of the layer count, or 'auto'; got {spec!r}")
            if auto_k is None:
                raise ValueError(
                    "prune_layers='auto' needs the model's importance profile: compute it with Pipeline.importance() "
                    "(or ship importance.json beside the weights)"
                )
            k = auto_k
        elif isinstance(spec, bool):
            raise ValueError(f"prune_layers must be an int, a fraction or 'auto'; got {spec!r}")
        elif isinstance(spec, int):
            k = spec
        elif isinstance(spec, float):
            if not 0.0 <= spec < 1.0:
                raise ValueError(f"a fractional prune_layers must lie in [0, 1); got {spec}")
            k = int(round(spec * num_layers))
        else:
            raise ValueError(f"prune_layers must be an int, a fraction or 'auto'; got {spec!r}")
        if not 0 <= k < num_layers:
            raise ValueError(f"prune_layers={k} is out of range: the model has {num_layers} layers (0 <= k < {num_layers})")
        return k

    def pruned_layers(self, num_layers: int, auto_k: int | None = None) -> tuple[int, ...]:
        """Indices of the layers skipped in the prefill: the last k."""
        k = self.num_pruned(num_layers, auto_k)
        return tuple(range(num_layers - k, num_layers))


def parse_prune_layers(value) -> PruneSpec:
    """A user's k, as typed on a command line, in a form field or in a JSON body: 'auto', an int k, a fraction of
    the layer count such as 0.33 (as a number or as text), or empty / None for the default (L/3). Range checks are
    `PopConfig.num_pruned`'s, once the model's layer count is known."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return PopConfig().prune_layers
    if isinstance(value, bool):
        raise ValueError(f"prune_layers must be a layer count, a fraction of the layers, or 'auto'; got {value!r}")
    if isinstance(value, (int, float)):
        return int(value) if float(value).is_integer() else float(value)
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"prune_layers must be a layer count, a fraction of the layers, or 'auto'; got {value!r}") from None
    return int(number) if number.is_integer() else number


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def check_full_tail(full_tail) -> int | str:
    if full_tail != "text" and (isinstance(full_tail, bool) or not isinstance(full_tail, int) or full_tail < 1):
        raise ValueError(f"full_tail must be a positive int or 'text', got {full_tail!r}")
    return full_tail


def check_max_new_tokens(max_new_tokens) -> int:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    return max_new_tokens
