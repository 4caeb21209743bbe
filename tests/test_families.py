"""Family-specific behaviour: Qwen3-VL positions and deepstack, Gemma-3 windows and image blocks."""
from __future__ import annotations

import pytest
import torch

from pop_vlm import PopConfig
from pop_vlm.families import detect_family, supported_architectures
from pop_vlm.pop import make_plan

from .conftest import QUESTION


def test_qwen3_vl_boundary_and_decode_positions_equal_unpruned_run(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    inputs = pipe.build_inputs(picture, QUESTION)
    answer = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=2), max_new_tokens=5)
    prompt = pipe.adapter.encode(inputs)
    # The unpruned run's positions: HF's own rope index over the prompt followed by the generated tokens.
    ids = torch.cat([inputs["input_ids"], torch.tensor([answer.token_ids])], dim=1)
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(answer.token_ids), dtype=torch.int)], dim=1)
    reference, _ = pipe.model.model.get_rope_index(ids, types, image_grid_thw=inputs["image_grid_thw"])
    n = prompt.length
    assert torch.equal(pipe.adapter.positions_between(prompt, n - 1, n), reference[..., n - 1:n])
    for step in range(len(answer.token_ids)):
        assert torch.equal(pipe.adapter.decode_positions(prompt, n + step), reference[..., n + step:n + step + 1])
    assert prompt.n_image_tokens > 0 and answer.n_image_tokens == prompt.n_image_tokens


def test_qwen3_vl_refuses_to_prune_deepstack_layers(pipelines):
    pipe = pipelines("tiny-qwen3-vl")  # 6 layers, deepstack features after layers 0 and 1
    assert pipe.adapter.protected_layers == {0, 1}
    make_plan(pipe.adapter, "pop", PopConfig(prune_layers=4))
    with pytest.raises(ValueError, match="deepstack"):
        make_plan(pipe.adapter, "pop", PopConfig(prune_layers=5))
    with pytest.raises(ValueError, match="deepstack"):
        make_plan(pipe.adapter, "static", PopConfig(prune_layers=5))


@pytest.mark.parametrize("name", ["tiny-gemma3-text", "tiny-gemma3-vlm"])
def test_gemma3_prompt_longer_than_sliding_window(pipelines, picture, name):
    pipe = pipelines(name)
    window = pipe.adapter.config.sliding_window
    question = " ".join(["what is the colour of the shape on the left"] * 3)
    inputs = pipe.build_inputs(picture if pipe.is_multimodal else None, question)
    assert inputs["input_ids"].shape[1] > 2 * window
    full = pipe.generate(inputs, mode="full", max_new_tokens=4)
    reference = pipe.model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert full.token_ids == reference.tolist()[: len(full.token_ids)]
    pop0 = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=0), max_new_tokens=4)
    assert pop0.token_ids == full.token_ids
    pop = pipe.generate(inputs, mode="pop", pop=PopConfig(prune_layers=3), max_new_tokens=4)
    assert len(pop.token_ids) >= 1


def test_gemma3_image_block_stays_bidirectional_in_pruned_prefill(pipelines, picture):
    pipe = pipelines("tiny-gemma3-vlm")
    adapter = pipe.adapter
    inputs = pipe.build_inputs(picture, "what is this")
    prompt = adapter.encode(inputs)
    n = prompt.length - 1
    cache = adapter.new_cache()
    kept = make_plan(adapter, "pop", PopConfig(prune_layers=2)).kept
    masks = adapter.masks(prompt.embeds[:, :n], cache, kept, prompt, (0, n))
    image_positions = prompt.image_mask[0, :n].nonzero().flatten().tolist()
    first, last = image_positions[0], image_positions[-1]
    full_layer = next(i for i in kept if adapter.layer_types[i] == "full_attention")
    mask = masks[full_layer]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    assert bool(allowed[0, 0, first, last])  # an early image token sees a later one of its block
    text_before = first - 1
    assert not bool(allowed[0, 0, text_before, last])  # text stays causal
    # Behaviour: changing the last image token changes the first image token's output (not so if causal).
    with torch.inference_mode():
        base = adapter.run_layers(prompt.embeds[:, :n], adapter.positions_between(prompt, 0, n), adapter.new_cache(), kept, prompt, (0, n))
        changed = prompt.embeds.clone()
        changed[0, last] += 1.0
        prompt.embeds = changed
        moved = adapter.run_layers(changed[:, :n], adapter.positions_between(prompt, 0, n), adapter.new_cache(), kept, prompt, (0, n))
    assert not torch.allclose(base[0, first], moved[0, first])


def test_unsupported_architecture_lists_the_supported_ones():
    class Config:
        architectures = ["BertForMaskedLM"]

    class Model(torch.nn.Module):
        config = Config()

    with pytest.raises(ValueError) as err:
        detect_family(Model())
    for arch in ("Qwen3VLForConditionalGeneration", "Gemma3ForCausalLM", "LlamaForCausalLM"):
        assert arch in str(err.value)
    assert set(supported_architectures()) >= {"Qwen3ForCausalLM", "Qwen2ForCausalLM", "Gemma3ForConditionalGeneration"}


def test_prompt_ending_in_an_image_token_is_refused(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    inputs = pipe.processor(images=[picture], text=["<|vision_start|><|image_pad|>"], return_tensors="pt")
    with pytest.raises(ValueError, match="ends with an image token"):
        pipe.generate(dict(inputs), mode="pop", max_new_tokens=2)
    assert pipe.generate(dict(inputs), mode="full", max_new_tokens=2).token_ids  # the plain model does not care
