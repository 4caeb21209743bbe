"""One preprocessing and one vision-encoder pass shared by several runs of the same request (full vs POP)."""
from __future__ import annotations

import pytest
import torch

from pop_vlm import PopConfig

from .conftest import QUESTION


def vision_tower(pipe):
    outer = pipe.model.model
    return getattr(outer, "visual", None) or outer.vision_tower


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-gemma3-vlm"])
def test_prepared_prompt_runs_the_vision_encoder_once_and_answers_as_alone(pipelines, picture, name):
    pipe = pipelines(name)
    pop = PopConfig(prune_layers=2)
    calls = []
    hook = vision_tower(pipe).register_forward_hook(lambda *args: calls.append(1))
    try:
        prepared = pipe.prepare(picture, QUESTION)
        shared = {mode: pipe.answer_prepared(prepared, mode=mode, pop=pop, max_new_tokens=4, output_scores=True)
                  for mode in ("full", "pop", "static")}
        assert len(calls) == 1
        alone = {mode: pipe.answer(picture, QUESTION, mode=mode, pop=pop, max_new_tokens=4, output_scores=True)
                 for mode in ("full", "pop")}
        assert len(calls) == 3
    finally:
        hook.remove()
    for mode, answer in alone.items():
        assert shared[mode].token_ids == answer.token_ids
        torch.testing.assert_close(shared[mode].scores[0], answer.scores[0])
    assert shared["full"].scores[0].ne(shared["pop"].scores[0]).any()
    timings = [a.timings for a in shared.values()]
    assert timings[0].vision_s > 0 and timings[0].preprocess_s > 0
    assert len({(t.preprocess_s, t.vision_s) for t in timings}) == 1  # one measurement, reported by each run
    for t in timings:
        assert t.ttft_s == pytest.approx(t.preprocess_s + t.vision_s + t.prefill_s + t.first_token_s)


def test_prepared_prompt_checks_before_any_model_work(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    prepared = pipe.prepare(picture, QUESTION)
    with pytest.raises(ValueError, match="out of range"):
        pipe.stream_prepared(prepared, mode="pop", pop=PopConfig(prune_layers=99))
    with pytest.raises(ValueError, match="cached conversation"):
        pipe.stream_prepared(prepared, mode="pop", reuse_prefix=True)
    assert prepared.prompt is None  # nothing was encoded


def test_warm_up_runs_each_mode(pipelines):
    pipe = pipelines("tiny-qwen3-vl")
    prefills = []  # calls of the first decoder layer with more than one token: one prefill per mode
    hook = pipe.adapter.layers[0].register_forward_pre_hook(
        lambda module, args: prefills.append(1) if args[0].shape[1] > 1 else None)
    try:
        pipe.warm_up(max_new_tokens=2)
    finally:
        hook.remove()
    assert len(prefills) == 2
