"""The tail through the skipped layers only: the same result as running the tail through all L layers after the
pruned prefix (the method as first written down), with the kept layers' work for the tail done once."""
from __future__ import annotations

import pytest
import torch

from pop_vlm import PopConfig
from pop_vlm.generate import decode_one_token
from pop_vlm.pop import Segment, make_plan, plan_segments, prefill, project_skipped_kv, pruned_prefill

from .conftest import QUESTION, image_for

TINY_MODELS = ["tiny-qwen3-vl", "tiny-gemma3-vlm", "tiny-gemma3-text", "tiny-llama"]


def reference_prefill(adapter, prompt, cache, plan, segments):
    """Each segment alone through its own stack: a full segment (the boundary token, a full tail, earlier turns)
    through all L layers, a pruned one through the kept layers plus the KV projections. Returns the last logits."""
    for segment in segments:
        layers = plan.decode_layers if segment.full else plan.kept
        hidden = pruned_prefill(adapter, prompt, cache, layers, segment.end, start=segment.start)
        if not segment.full and plan.mode == "pop" and plan.kv_projection:
            project_skipped_kv(adapter, prompt, cache, hidden, plan.pruned, plan.fused, start=segment.start)
    return adapter.logits(hidden[:, -1:])[:, -1]


def greedy_continuation(adapter, prompt, cache, plan, logits, steps=4):
    tokens = [int(logits[0].argmax())]
    for index in range(prompt.length, prompt.length + steps):
        logits = decode_one_token(adapter, prompt, cache, tokens[-1], index, plan.decode_layers)
        tokens.append(int(logits[0].argmax()))
    return tokens


def assert_close_relative(ours, theirs, rtol=1e-5):
    """fp32 agreement to `rtol` of the tensor's scale: the two paths multiply the same numbers in matrices of
    other shapes, so entries near zero differ by rounding of the size of the largest ones."""
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=rtol * float(theirs.abs().max()))


def assert_caches_close(ours, theirs, num_layers):
    for layer in range(num_layers):
        assert ours.get_seq_length(layer) == theirs.get_seq_length(layer)
        if ours.get_seq_length(layer):
            assert_close_relative(ours.layers[layer].keys, theirs.layers[layer].keys)
            assert_close_relative(ours.layers[layer].values, theirs.layers[layer].values)


@pytest.mark.parametrize("kv_projection", [True, False])
@pytest.mark.parametrize("full_tail", [1, 4, "text"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_tail_through_skipped_layers_equals_tail_through_all(pipelines, picture, name, full_tail, kv_projection):
    pipe = pipelines(name)
    adapter = pipe.adapter
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    plan = make_plan(adapter, "pop", PopConfig(prune_layers=2, kv_projection=kv_projection))
    with torch.inference_mode():
        prompt = adapter.encode(inputs)
        segments = plan_segments(plan, prompt, full_tail)
        assert [s.full for s in segments] == [False, True]
        ours_cache, theirs_cache = adapter.new_cache(), adapter.new_cache()
        ours = prefill(adapter, prompt, ours_cache, plan, full_tail=full_tail)
        theirs = reference_prefill(adapter, prompt, theirs_cache, plan, segments)
        assert_close_relative(ours, theirs)
        assert_caches_close(ours_cache, theirs_cache, adapter.num_layers)
        assert (greedy_continuation(adapter, prompt, ours_cache, plan, ours)
                == greedy_continuation(adapter, prompt, theirs_cache, plan, theirs))


@pytest.mark.parametrize("full_tail", [1, 4, "text"])
@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-gemma3-vlm"])
def test_follow_up_from_cache_equals_tail_through_all_layers(pipelines, picture, name, full_tail):
    """A cached conversation's next turn (prefill from `start` > 0) against the whole conversation run from
    scratch the first way: each turn's tail, and the first answer's tokens, through all L layers."""
    pipe = pipelines(name)
    pipe.prefix_cache.clear()
    pop = PopConfig(prune_layers=2, full_tail=full_tail)
    chat = pipe.chat(picture, mode="pop", pop=pop, max_new_tokens=4)
    first = chat.ask("What colour is the square?")
    second = chat.ask("And the circle?", output_scores=True)
    reused = second.timings.n_cached_tokens
    assert reused > first.n_image_tokens

    adapter = pipe.adapter
    plan = make_plan(adapter, "pop", pop)
    inputs = pipe.build_chat_inputs(chat.messages[:-1])
    with torch.inference_mode():
        prompt = adapter.encode(inputs)
        first_turn = plan_segments(plan, _prefix(prompt, first.n_prompt_tokens), full_tail)
        first_turn[-1] = Segment(first_turn[-1].start, reused, True)  # its answer's tokens ran full as decode steps
        second_turn = plan_segments(plan, prompt, full_tail, start=reused)
        scratch = reference_prefill(adapter, prompt, adapter.new_cache(), plan, first_turn + second_turn)
    assert_close_relative(second.scores[0], scratch[0].float())


def _prefix(prompt, end):
    from dataclasses import replace

    mask = None if prompt.image_mask is None else prompt.image_mask[:, :end]
    return replace(prompt, input_ids=prompt.input_ids[:, :end], embeds=prompt.embeds[:, :end], image_mask=mask)


@pytest.mark.parametrize("full_tail", [1, 3])
@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-llama"])
def test_pop_runs_each_layer_once_and_the_tail_through_k_layers(pipelines, picture, name, full_tail):
    pipe = pipelines(name)
    adapter = pipe.adapter
    k = 2
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    plan = make_plan(adapter, "pop", PopConfig(prune_layers=k))
    calls: list[tuple[int, int]] = []  # (layer, tokens in the call)
    hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: calls.append((i, args[0].shape[1])))
             for i, layer in enumerate(adapter.layers)]
    try:
        with torch.inference_mode():
            prompt = adapter.encode(inputs)
            prefill(adapter, prompt, adapter.new_cache(), plan, full_tail=full_tail)
    finally:
        for hook in hooks:
            hook.remove()
    n = prompt.length
    assert [layer for layer, _ in calls] == list(range(adapter.num_layers))  # every layer once, in order
    assert all(tokens == n for layer, tokens in calls if layer in plan.kept)
    tail_calls = [(layer, tokens) for layer, tokens in calls if layer in plan.pruned]
    assert len(tail_calls) == k and all(tokens == full_tail for _, tokens in tail_calls)
