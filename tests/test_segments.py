"""Segmented prefill, the full-model tail, and conversations that reuse their cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pop_vlm import PopConfig
from pop_vlm.chat import PrefixCache, cache_nbytes
from pop_vlm.pop import (Segment, make_plan, plan_segments, prefill, project_skipped_kv, pruned_prefill,
                         tail_through_skipped)

from .conftest import QUESTION, image_for


def first_logits(pipe, inputs, plan, segments=None, full_tail=1):
    adapter = pipe.adapter
    with torch.inference_mode():
        prompt = adapter.encode(inputs)
        cache = adapter.new_cache()
        logits = prefill(adapter, prompt, cache, plan, segments=segments, full_tail=full_tail)
    return logits, cache, prompt


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-gemma3-text", "tiny-llama"])
def test_segments_with_every_layer_full_reproduce_the_full_model(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    full = make_plan(pipe.adapter, "full")
    whole, whole_cache, prompt = first_logits(pipe, inputs, full)
    n = prompt.length
    cuts = [0, n // 3, n // 3 + 1, n - 2, n]
    segments = [Segment(a, b, True) for a, b in zip(cuts, cuts[1:]) if b > a]
    pieces, piece_cache, _ = first_logits(pipe, inputs, full, segments=segments)
    torch.testing.assert_close(pieces, whole, rtol=1e-4, atol=1e-4)
    for layer in range(pipe.num_layers):
        torch.testing.assert_close(piece_cache.layers[layer].keys, whole_cache.layers[layer].keys, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-gemma3-vlm", "tiny-qwen3"])
def test_full_tail_one_is_the_papers_pop(pipelines, picture, name):
    pipe = pipelines(name)
    adapter = pipe.adapter
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    plan = make_plan(adapter, "pop", PopConfig(prune_layers=2))
    segmented, _, prompt = first_logits(pipe, inputs, plan, full_tail=1)
    assert plan_segments(plan, prompt, 1) == [Segment(0, prompt.length - 1, False), Segment(prompt.length - 1, prompt.length, True)]
    n = prompt.length
    with torch.inference_mode():  # the three pieces of the method, called one by one
        cache = adapter.new_cache()
        hidden = pruned_prefill(adapter, prompt, cache, plan.kept, n)  # x_N's kept-layer pass rides along
        project_skipped_kv(adapter, prompt, cache, hidden[:, : n - 1], plan.pruned)
        boundary = tail_through_skipped(adapter, prompt, cache, plan, hidden[:, n - 1:], n - 1)
        paper = adapter.logits(boundary)[:, -1]
    torch.testing.assert_close(segmented, paper, rtol=0, atol=0)


def test_full_tail_text_runs_everything_after_the_image_full(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    inputs = pipe.build_inputs(picture, QUESTION)
    plan = make_plan(pipe.adapter, "pop", PopConfig(prune_layers=2, full_tail="text"))
    prompt = pipe.adapter.encode(inputs)
    last_image = int(prompt.image_mask[0].nonzero().max())
    segments = plan_segments(plan, prompt, "text")
    assert segments == [Segment(0, last_image + 1, False), Segment(last_image + 1, prompt.length, True)]
    paper = pipe.generate(inputs, pop=PopConfig(prune_layers=2), max_new_tokens=1, output_scores=True)
    text_tail = pipe.generate(inputs, pop=PopConfig(prune_layers=2, full_tail="text"), max_new_tokens=1, output_scores=True)
    tail4 = pipe.generate(inputs, pop=PopConfig(prune_layers=2, full_tail=4), max_new_tokens=1, output_scores=True)
    assert not torch.allclose(paper.scores[0], text_tail.scores[0], atol=1e-5)
    assert not torch.allclose(paper.scores[0], tail4.scores[0], atol=1e-5)
    everything = pipe.generate(inputs, pop=PopConfig(prune_layers=2, full_tail=10_000), max_new_tokens=1, output_scores=True)
    full = pipe.generate(inputs, mode="full", max_new_tokens=1, output_scores=True)
    torch.testing.assert_close(everything.scores[0], full.scores[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="full_tail"):
        PopConfig(full_tail=0)


def test_gemma_segment_may_not_split_an_image(pipelines, picture):
    pipe = pipelines("tiny-gemma3-vlm")
    inputs = pipe.build_inputs(picture, "what")
    prompt = pipe.adapter.encode(inputs)
    image_positions = prompt.image_mask[0].nonzero().flatten().tolist()
    inside = image_positions[1]  # a cut between the image's first and second token
    with pytest.raises(ValueError, match="inside an image"):
        pipe.generate(inputs, pop=PopConfig(prune_layers=2, full_tail=prompt.length - inside), max_new_tokens=1)
    pipe.generate(inputs, pop=PopConfig(prune_layers=2, full_tail="text"), max_new_tokens=1)


@pytest.mark.parametrize("mode", ["full", "pop"])
def test_follow_up_from_cache_equals_the_conversation_from_scratch(pipelines, picture, mode):
    pipe = pipelines("tiny-qwen3-vl")
    pipe.prefix_cache.clear()
    pop = PopConfig(prune_layers=2)
    chat = pipe.chat(picture, mode=mode, pop=pop, max_new_tokens=5)
    first = chat.ask("What colour is the square?")
    assert first.timings.n_cached_tokens == 0
    second = chat.ask("And the circle?", output_scores=True)
    assert second.timings.n_cached_tokens > first.n_image_tokens  # the image and the first turn were reused
    assert second.timings.vision_s < first.timings.vision_s

    # the same conversation from scratch, with the same segments the cached run used
    inputs = pipe.build_chat_inputs(chat.messages[:-1])
    plan = make_plan(pipe.adapter, mode, pop)
    n1 = first.n_prompt_tokens
    reused = second.timings.n_cached_tokens
    n2 = second.n_prompt_tokens
    if mode == "full":
        segments = [Segment(0, n2, True)]
    else:
        segments = [Segment(0, n1 - 1, False), Segment(n1 - 1, reused, True), Segment(reused, n2 - 1, False),
                    Segment(n2 - 1, n2, True)]
    scratch, _, _ = first_logits(pipe, inputs, plan, segments=segments)
    torch.testing.assert_close(second.scores[0], scratch[0].float(), rtol=1e-4, atol=1e-4)
    if mode == "full":  # and in full mode, it is the plain model's answer to the whole conversation
        plain = pipe.generate(inputs, mode="full", max_new_tokens=5)
        assert plain.token_ids == second.token_ids


def test_prefix_cache_keeps_to_its_budget_and_to_its_image(pipelines):
    pipe = pipelines("tiny-qwen3-vl")
    red = Image.fromarray(np.full((64, 64, 3), (220, 30, 30), dtype=np.uint8))
    blue = Image.fromarray(np.full((64, 64, 3), (40, 70, 220), dtype=np.uint8))
    pipe.prefix_cache.clear()
    pipe.chat(red, max_new_tokens=3).ask("What colour?")
    one_entry = pipe.prefix_cache.nbytes
    assert len(pipe.prefix_cache) == 1 and one_entry > 0
    # a conversation about another image never starts from the red one's cache
    blue_answer = pipe.chat(blue, max_new_tokens=3).ask("What colour?")
    assert blue_answer.timings.n_cached_tokens == 0
    assert len(pipe.prefix_cache) == 2
    # a budget for about one conversation keeps only the most recent
    small = PrefixCache(max_bytes=int(one_entry * 1.5))
    pipe.prefix_cache, saved = small, pipe.prefix_cache
    try:
        pipe.chat(red, max_new_tokens=3).ask("What colour?")
        pipe.chat(blue, max_new_tokens=3).ask("What colour?")
        assert len(small) == 1 and small.nbytes <= small.max_bytes
        again = pipe.chat(red, max_new_tokens=3).ask("What colour?")
        assert again.timings.n_cached_tokens == 0  # evicted
    finally:
        pipe.prefix_cache = saved
    assert cache_nbytes(pipe.adapter.new_cache()) == 0
