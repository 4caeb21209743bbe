"""The engine's invariants on every supported family, with tiny random models of the real classes:

- `mode="pop"` with k = 0 gives exactly what `mode="full"` gives, and greedy `mode="full"` gives exactly what
  `model.generate` gives;
- after a POP prefill every layer's KV cache covers the prompt positions, and a skipped layer's entries equal its
  K/V projection of the last kept layer's output;
- the first generated token comes from all L layers (the boundary), unless `boundary=False`;
- `static` is the model with the k layers deleted; the fused K/V projection equals the per-layer one.
(tests/test_tail.py: the boundary token's pass through the kept layers rides with the prefill.)
"""
from __future__ import annotations

import copy

import pytest
import torch

from pop_vlm import PopConfig
from pop_vlm.pop import make_plan, project_skipped_kv, pruned_prefill

from .conftest import FAMILIES, QUESTION, image_for


@pytest.mark.parametrize("name", FAMILIES)
def test_full_greedy_equals_model_generate(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    reference = pipe.model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    answer = pipe.generate(inputs, mode="full", max_new_tokens=8)
    assert answer.token_ids == reference.tolist()[: len(answer.token_ids)]
    assert len(answer.token_ids) == len(reference) or answer.finish_reason == "stop"


@pytest.mark.parametrize("name", FAMILIES)
def test_pop_with_no_pruned_layer_equals_full(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    full = pipe.generate(inputs, mode="full", max_new_tokens=6, output_scores=True)
    pop0 = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=0), max_new_tokens=6, output_scores=True)
    assert pop0.token_ids == full.token_ids
    assert pop0.pruned_layers == []
    for a, b in zip(full.scores, pop0.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_pop_and_static_differ_from_full_and_each_other(pipelines, picture, name):
    """A check that pruning really changes the computation (the other tests would pass on a no-op)."""
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    scores = {m: pipe.generate(inputs, mode=m, max_new_tokens=1, output_scores=True).scores[0] for m in ("full", "pop", "static")}
    assert not torch.allclose(scores["full"], scores["pop"], atol=1e-5)
    assert not torch.allclose(scores["pop"], scores["static"], atol=1e-5)


def _pop_prefill_state(pipe, inputs, k):
    adapter = pipe.adapter
    plan = make_plan(adapter, "pop", PopConfig(prune_layers=k))
    with torch.inference_mode():
        prompt = adapter.encode(inputs)
        cache = adapter.new_cache()
        hidden = pruned_prefill(adapter, prompt, cache, plan.kept, prompt.length - 1)
        project_skipped_kv(adapter, prompt, cache, hidden, plan.pruned, fused=True)
    return plan, prompt, cache, hidden


def _hand_projection(pipe, layer, hidden, positions):
    """K/V of a layer from h, written out with the model's own modules: norm, W_K, k_norm, RoPE, W_V."""
    adapter = pipe.adapter
    attn = adapter.layers[layer].self_attn
    x = adapter.layers[layer].input_layernorm(hidden)
    keys = attn.k_proj(x).view(1, x.shape[1], -1, attn.head_dim)
    if getattr(attn, "k_norm", None) is not None:
        keys = attn.k_norm(keys)
    keys = keys.transpose(1, 2)
    values = attn.v_proj(x).view(1, x.shape[1], -1, attn.head_dim).transpose(1, 2)
    cos, sin = adapter.rotary(hidden, positions)[adapter.layer_types[layer]]
    module = __import__(type(attn).__module__, fromlist=["apply_rotary_pos_emb"])
    keys, _ = module.apply_rotary_pos_emb(keys, keys, cos, sin)
    return keys, values


@pytest.mark.parametrize("name", FAMILIES)
def test_skipped_layers_cache_holds_their_projection_of_last_kept_output(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    plan, prompt, cache, hidden = _pop_prefill_state(pipe, inputs, k=2)
    n = prompt.length - 1
    positions = pipe.adapter.positions_between(prompt, 0, n)
    with torch.inference_mode():
        for layer in plan.pruned:
            keys, values = _hand_projection(pipe, layer, hidden, positions)
            cached_k, cached_v = cache.layers[layer].keys, cache.layers[layer].values
            window = getattr(cache.layers[layer], "sliding_window", None)
            if window:  # sliding-window layers keep only their window
                assert cached_k.shape[-2] == min(n, window - 1)
                keys, values = keys[..., -cached_k.shape[-2]:, :], values[..., -cached_k.shape[-2]:, :]
            else:
                assert cached_k.shape[-2] == n  # every prompt position x_1..x_{N-1}
            torch.testing.assert_close(cached_k, keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(cached_v, values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_kept_layers_cache_equals_plain_prefill(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    plan, prompt, cache, _ = _pop_prefill_state(pipe, inputs, k=2)
    truncated = {k: (v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids") else v)
                 for k, v in inputs.items()}
    with torch.inference_mode():
        plain = pipe.model(**truncated, use_cache=True).cache
    for layer in plan.kept:
        torch.testing.assert_close(cache.layers[layer].keys, plain.layers[layer].keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.layers[layer].values, plain.layers[layer].values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_projection_equals_unfused(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    fused = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=3), max_new_tokens=4, output_scores=True)
    plain = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=3, fused=False), max_new_tokens=4, output_scores=True)
    assert fused.token_ids == plain.token_ids
    for a, b in zip(fused.scores, plain.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _delete_layers(model, adapter, pruned):
    """A copy of the model with the given decoder layers removed (ShortGPT-style static removal)."""
    clone = copy.deepcopy(model)
    decoder = type(adapter)(clone).decoder
    keep = [i for i in range(len(decoder.layers)) if i not in pruned]
    decoder.layers = torch.nn.ModuleList([decoder.layers[i] for i in keep])
    for new_index, layer in enumerate(decoder.layers):
        layer.self_attn.layer_idx = new_index
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = new_index
    config = decoder.config
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    return clone


@pytest.mark.parametrize("name", FAMILIES)
def test_static_equals_model_with_layers_deleted(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    static = pipe.generate(inputs, mode="static", pop=PopConfig(prune_layers=2), max_new_tokens=6)
    shortened = _delete_layers(pipe.model, pipe.adapter, set(static.pruned_layers))
    reference = shortened.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert static.token_ids == reference.tolist()[: len(static.token_ids)]


@pytest.mark.parametrize("name", FAMILIES)
def test_without_boundary_first_token_comes_from_pruned_stack(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    config = PopConfig(prune_layers=2)
    no_boundary = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=2, boundary=False), max_new_tokens=1, output_scores=True)
    static = pipe.generate(inputs, mode="static", pop=config, max_new_tokens=1, output_scores=True)
    pop = pipe.generate(inputs, mode="pop", pop=config, max_new_tokens=1, output_scores=True)
    torch.testing.assert_close(no_boundary.scores[0], static.scores[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(no_boundary.scores[0], pop.scores[0], atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3-vlm"])
def test_without_kv_projection_runs_and_changes_decode(pipelines, picture, name):
    pipe = pipelines(name)
    inputs = pipe.build_inputs(image_for(pipe, picture), QUESTION)
    with_kv = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=2), max_new_tokens=3, output_scores=True)
    without = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=2, kv_projection=False), max_new_tokens=3, output_scores=True)
    assert len(without.token_ids) == len(with_kv.token_ids)
    assert not torch.allclose(with_kv.scores[0], without.scores[0], atol=1e-5)
