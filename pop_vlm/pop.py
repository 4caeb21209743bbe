"""Prefill-Only Pruning: the three pieces of the method.

1. `pruned_prefill` — the prompt's tokens run through the kept layers [0, L-k) only (in POP every prompt token,
   the tail's included: their pass through the kept layers is the same computation either way).
2. `project_skipped_kv` — each skipped layer still gets its KV cache, projected from the last kept layer's
   output h through that layer's own input norm, W_K (k_norm, RoPE) and W_V; its attention and MLP never run.
   `FusedKVProjection` does this for all skipped layers in one GEMM.
3. `tail_through_skipped` — the paper's boundary step: the last prompt token x_N (or the last `full_tail` tokens)
   continues from its kept-layer output through the k skipped layers, against the projected cache, so the first
   generated token comes from all L layers.

`prefill` puts them together for each mode; `PrefillPlan` says which layers each stage uses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import PopConfig, check_full_tail, check_mode
from .families.base import FamilyAdapter, Prompt


@dataclass(frozen=True)
class PrefillPlan:
    mode: str
    pruned: tuple[int, ...]  # layers the prefill skips (the deepest k)
    kept: tuple[int, ...]  # layers the prefill runs
    decode_layers: tuple[int, ...]  # layers each decode step runs
    kv_projection: bool
    boundary: bool
    fused: bool


def make_plan(adapter: FamilyAdapter, mode: str = "pop", pop: PopConfig | None = None, auto_k: int | None = None) -> PrefillPlan:
    check_mode(mode)
    pop = pop or PopConfig()
    every = tuple(range(adapter.num_layers))
    if mode == "full":
        return PrefillPlan(mode, (), every, every, kv_projection=False, boundary=False, fused=pop.fused)
    pruned = pop.pruned_layers(adapter.num_layers, auto_k)
    clash = sorted(set(pruned) & adapter.protected_layers)
    if clash:
        raise ValueError(
            f"cannot prune layers {clash} of this {adapter.name} model: they receive the vision tower's deepstack "
            f"features (layers {sorted(adapter.protected_layers)}); prune at most "
            f"{adapter.num_layers - 1 - max(adapter.protected_layers)} layers"
        )
    kept = tuple(i for i in every if i not in pruned)
    if mode == "static":
        return PrefillPlan(mode, pruned, kept, kept, kv_projection=False, boundary=False, fused=pop.fused)
    return PrefillPlan(mode, pruned, kept, every, pop.kv_projection, pop.boundary, pop.fused)


# ---- 1. pruned prefill ---------------------------------------------------------------------------------------
def pruned_prefill(adapter: FamilyAdapter, prompt: Prompt, cache, layers, end: int, start: int = 0) -> torch.Tensor:
    """Run prompt tokens [start, end) through `layers` (the kept ones; a full segment passes all of them); returns
    their output hidden states."""
    positions = adapter.positions_between(prompt, start, end)
    return adapter.run_layers(prompt.embeds[:, start:end], positions, cache, layers, prompt=prompt, span=(start, end))


# ---- 2. independent KV projections ----------------------------------------------------------------------------
def project_skipped_kv(adapter: FamilyAdapter, prompt: Prompt, cache, hidden, skipped, fused: bool = True,
                       start: int = 0) -> None:
    """Write each skipped layer's K/V for prompt tokens [start, start + T) from `hidden` (the last kept layer's
    output for them)."""
    if not skipped:
        return
    positions = adapter.positions_between(prompt, start, start + hidden.shape[1])
    rope = adapter.rotary(hidden, positions)
    if fused:
        for layer, keys, values in adapter.fused_kv(tuple(skipped))(hidden, rope):
            cache.update(keys, values, layer)
    else:
        for layer in skipped:
            cache.update(*adapter.project_kv(layer, hidden, rope), layer)


# ---- 3. the tail through the skipped layers ---------------------------------------------------------------------
def tail_through_skipped(adapter: FamilyAdapter, prompt: Prompt, cache, plan: PrefillPlan, hidden: torch.Tensor,
                         start: int) -> torch.Tensor:
    """Run the tail tokens [start, start + T) — the paper's boundary token x_N when the tail is one token — through
    the skipped layers, from `hidden`, their output of the kept layers. They attend to the projected cache and to
    themselves. Their pass through the kept layers is the pruned prefill's (attention is causal: a token's hidden
    state at a kept layer depends only on the tokens up to it), so only the k skipped layers are extra work."""
    span = (start, start + hidden.shape[1])
    positions = adapter.positions_between(prompt, *span)
    return adapter.run_layers(hidden, positions, cache, plan.pruned, prompt=prompt, span=span)


# ---- the prefill of each mode: segments ------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """Prompt tokens [start, end), run either through all layers (`full`) or pruned: the kept layers, plus the
    skipped layers' KV projections in POP. Each segment attends to the cache the earlier ones filled."""

    start: int
    end: int
    full: bool


def tail_length(prompt: Prompt, full_tail) -> int:
    """How many of the prompt's last tokens run through the full model (PopConfig.full_tail)."""
    if full_tail == "text":
        if prompt.image_mask is None or not bool(prompt.image_mask.any()):
            return 1  # no image: the paper's boundary token
        last_image = int(prompt.image_mask[0].nonzero().max())
        return max(1, prompt.length - 1 - last_image)
    return min(check_full_tail(full_tail), prompt.length)


def plan_segments(plan: PrefillPlan, prompt: Prompt, full_tail=1, start: int = 0) -> list[Segment]:
    """The segments of a prefill of prompt tokens [start, N) under `plan`.

    full: one full segment. static, and POP without its boundary: one pruned segment. POP: pruned, then the last
    `full_tail` tokens full (1 is the paper's boundary step).
    """
    n = prompt.length
    if not 0 <= start < n:
        raise ValueError(f"nothing to prefill: start {start} of a {n}-token prompt")
    if plan.mode == "full":
        return [Segment(start, n, True)]
    if plan.mode == "static" or not plan.boundary:
        return [Segment(start, n, False)]
    if prompt.image_mask is not None and bool(prompt.image_mask[0, -1]):
        raise ValueError(
            "the prompt ends with an image token; POP runs the last prompt token through the full model and "
            "expects it to be text (a chat template with a generation prompt ends with text)"
        )
    boundary = max(start, n - tail_length(prompt, full_tail))
    segments = [Segment(start, boundary, False)] if boundary > start else []
    return segments + [Segment(boundary, n, True)]


def pair_tails(plan: PrefillPlan, segments: list[Segment]) -> list[tuple[Segment, Segment | None]]:
    """Group each full segment that follows a pruned one with it, as (pruned, tail); other segments stand alone
    as (segment, None). In POP the pair shares one pass through the kept layers (see `run_segment`)."""
    groups: list[tuple[Segment, Segment | None]] = []
    for segment in segments:
        previous = groups[-1] if groups else None
        if (plan.mode == "pop" and segment.full and previous is not None and previous[1] is None
                and not previous[0].full and previous[0].end == segment.start):
            groups[-1] = (previous[0], segment)
        else:
            groups.append((segment, None))
    return groups


def run_segment(adapter: FamilyAdapter, prompt: Prompt, cache, plan: PrefillPlan, segment: Segment,
                tail: Segment | None = None, before_tail=None) -> torch.Tensor:
    """Run one segment against the cache; returns the output hidden states of the last stack that ran.

    With a full `tail` right after a pruned `segment` (POP), the tail's tokens ride with the segment's pass through
    the kept layers, the skipped layers' K/V are projected for the segment's tokens only, and then the tail alone
    runs through the skipped layers. `before_tail` is called just before that last part (the clock's "prefill")."""
    end = tail.end if tail is not None else segment.end
    layers = plan.decode_layers if segment.full else plan.kept
    hidden = pruned_prefill(adapter, prompt, cache, layers, end, start=segment.start)
    if not segment.full and plan.mode == "pop" and plan.kv_projection:
        project_skipped_kv(adapter, prompt, cache, hidden[:, : segment.end - segment.start], plan.pruned,
                           plan.fused, start=segment.start)
    if tail is None:
        return hidden
    if before_tail is not None:
        before_tail()
    return tail_through_skipped(adapter, prompt, cache, plan, hidden[:, tail.start - segment.start:], tail.start)


def check_images_whole(adapter: FamilyAdapter, prompt: Prompt, segments: list[Segment]) -> None:
    """Gemma-3 attends within each image both ways: no segment may start inside an image."""
    if not adapter.bidirectional_image_blocks or prompt.image_mask is None:
        return
    inside = prompt.image_mask[0]
    for segment in segments[1:]:
        if 0 < segment.start < prompt.length and bool(inside[segment.start - 1]) and bool(inside[segment.start]):
            raise ValueError(
                f"a prefill segment would start inside an image (token {segment.start}); {adapter.name} attends "
                "within each image in both directions, so an image must stay in one segment"
            )


def prefill(adapter: FamilyAdapter, prompt: Prompt, cache, plan: PrefillPlan, clock=None, *, full_tail=1,
            start: int = 0, segments: list[Segment] | None = None) -> torch.Tensor:
    """Fill `cache` with prompt tokens [start, N) and return the logits of the first generated token (1, vocab).

    `clock`, when given, is called with "prefill" when everything but the last piece of work has run (POP: the
    kept layers over every prompt token and the KV projections) and with "first_token" when that last piece (POP:
    the tail through the skipped layers) and the logits are done.
    """
    clock = clock or (lambda stage: None)
    segments = segments if segments is not None else plan_segments(plan, prompt, full_tail, start)
    check_images_whole(adapter, prompt, segments)
    *head, (segment, tail) = pair_tails(plan, segments)
    for earlier, earlier_tail in head:
        run_segment(adapter, prompt, cache, plan, earlier, earlier_tail)
    if tail is not None:
        hidden = run_segment(adapter, prompt, cache, plan, segment, tail, before_tail=lambda: clock("prefill"))
    elif head:
        clock("prefill")
        hidden = run_segment(adapter, prompt, cache, plan, segment)
    else:
        hidden = run_segment(adapter, prompt, cache, plan, segment)
        clock("prefill")
    logits = adapter.logits(hidden[:, -1:])[:, -1]
    clock("first_token")
    return logits
