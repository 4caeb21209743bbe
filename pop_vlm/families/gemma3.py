"""Gemma-3: sliding-window and global layers with their own RoPE, (1 + w) RMSNorm, soft-capped logits, and a
bidirectional attention block over each image's tokens (VLM)."""
from __future__ import annotations

import torch
from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, get_block_sequence_ids_for_mask

from ..offline_tokenizers import GEMMA_CHAT_TEMPLATE, word_tokenizer
from ..scaling import scale_text, scale_vision_heads, scale_width
from .base import FamilyAdapter, Prompt, _single_sequence, randomise_norms

VLM = "Gemma3ForConditionalGeneration"
SLIDING, GLOBAL = "sliding_attention", "full_attention"


class Gemma3Adapter(FamilyAdapter):
    name = "gemma-3"
    architectures = (VLM, "Gemma3ForCausalLM")
    vlm_architectures = (VLM,)
    norm_weight_offset = 1.0
    bidirectional_image_blocks = True

    # ---- before a model exists ------------------------------------------------------------------------------
    @classmethod
    def attention_implementation(cls, device, architecture: str) -> str:
        if architecture == VLM:
            return "sdpa"  # flash-attention cannot keep the bidirectional attention within an image
        return super().attention_implementation(device, architecture)

    @classmethod
    def bench_config(cls, spec: dict, scale: float, vocab: int | None):
        import transformers

        text = scale_text(spec["text_config"], scale, vocab)
        vision = dict(spec["vision_config"])
        if scale != 1.0:
            vision["hidden_size"], vision["num_attention_heads"] = scale_vision_heads(
                vision["hidden_size"], vision["num_attention_heads"], scale)
            vision["intermediate_size"] = scale_width(vision["intermediate_size"], scale)
        ids = {k: spec[k] for k in ("image_token_id", "boi_token_id", "eoi_token_id")}
        if vocab:  # the special tokens move to the top of the shrunk vocabulary
            ids = {k: text["vocab_size"] - 1 - i for i, k in enumerate(ids)}
        pattern = text.pop("sliding_window_pattern")
        text["layer_types"] = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(text["num_hidden_layers"])]
        config = transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**text).to_dict(),
            vision_config=transformers.SiglipVisionConfig(**vision).to_dict(),
            mm_tokens_per_image=spec["mm_tokens_per_image"], **ids,
        )
        return config, {"image": ids["image_token_id"], "boi": ids["boi_token_id"], "eoi": ids["eoi_token_id"], "bos": 2}

    @classmethod
    def bench_image_processor(cls, model):
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        side = model.config.vision_config.image_size
        return Gemma3ImageProcessorPil(size={"height": side, "width": side})

    @classmethod
    def bench_prompt_ids(cls, model, special, head, tail, pixels):
        if pixels is None:
            return super().bench_prompt_ids(model, special, head, tail, pixels)
        n_image = model.config.mm_tokens_per_image  # a fixed number of soft tokens per image
        return [special["bos"]] + head + [special["boi"]] + [special["image"]] * n_image + [special["eoi"]] + tail

    @classmethod
    def tiny_models(cls) -> dict:
        return {"tiny-gemma3-vlm": tiny_vlm, "tiny-gemma3-text": tiny_text_model}

    # ---- the model ------------------------------------------------------------------------------------------
    def branch_modules(self, layer):
        """Gemma's sandwich norms: the branches are the outputs of post_attention_layernorm and
        post_feedforward_layernorm."""
        return [layer.post_attention_layernorm, layer.post_feedforward_layernorm]

    def _find_decoder(self, model):
        inner = model.model
        return getattr(inner, "language_model", inner)

    @property
    def is_multimodal(self) -> bool:
        return hasattr(self.model.model, "vision_tower")

    def encode(self, inputs: dict, start: int = 0) -> Prompt:
        input_ids = _single_sequence(inputs)
        image_mask, extras = None, {}
        if self.is_multimodal:
            image_token_id = self.model.config.image_token_id
            image_mask = input_ids == image_token_id
            token_ids = input_ids
            if image_token_id >= self.config.vocab_size:
                token_ids = input_ids.masked_fill(image_mask, 0)
            embeds = self.decoder.embed_tokens(token_ids)
            pixel_values = inputs.get("pixel_values")
            if pixel_values is not None and start > 0 and not bool(image_mask[0, start:].any()):
                pass  # every image is already in the cache: no vision work
            elif pixel_values is not None:
                features = self.model.model.get_image_features(pixel_values, return_dict=True).pooler_output
                features = features.to(embeds.dtype).reshape(-1, embeds.shape[-1])
                if int(image_mask.sum()) != features.shape[0]:
                    raise ValueError(
                        f"the prompt has {int(image_mask.sum())} image tokens but the images give {features.shape[0]} features"
                    )
                embeds = embeds.masked_scatter(image_mask[..., None], features)
            elif bool(image_mask.any()):
                raise ValueError("the prompt has image tokens but no pixel_values were given")
            extras["token_type_ids"] = image_mask.long()
            if not bool(image_mask.any()):
                image_mask = None
        else:
            embeds = self.decoder.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return Prompt(input_ids=input_ids, embeds=embeds, positions=positions, image_mask=image_mask, extras=extras)

    def rotary(self, hidden, positions):
        return {t: self.decoder.rotary_emb(hidden, positions, t) for t in set(self.layer_types)}

    def masks(self, hidden, cache, layer_ids, prompt, span):
        if prompt is None or span is None or prompt.image_mask is None or not bool(prompt.image_mask[:, span[0]:span[1]].any()):
            return super().masks(hidden, cache, layer_ids, prompt, span)
        # Image tokens attend to their whole image block (both directions), as in the unpruned model.
        token_types = prompt.extras["token_type_ids"][:, span[0]:span[1]]
        by_type = create_masks_for_vision_model(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=cache, position_ids=None,
            block_sequence_ids=get_block_sequence_ids_for_mask(token_types, device=hidden.device),
        )
        return {i: by_type[self.layer_types[i]] for i in layer_ids}


# ---- tiny models of the real classes --------------------------------------------------------------------------
def _tiny_text_config(vocab_size: int, num_layers: int, sliding_window: int, **extra):
    from transformers import Gemma3TextConfig

    layer_types = [SLIDING if (i + 1) % 3 else GLOBAL for i in range(num_layers)]
    return Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=sliding_window, layer_types=layer_types, max_position_embeddings=4096,
        final_logit_softcapping=30.0, initializer_range=0.2, **extra,
    )


def tiny_text_model(num_layers: int = 6, seed: int = 0, sliding_window: int = 8):
    """Gemma3ForCausalLM with random weights and a word-level tokenizer; returns (model, tokenizer)."""
    from transformers import Gemma3ForCausalLM

    tokenizer = word_tokenizer()
    config = _tiny_text_config(len(tokenizer), num_layers, sliding_window, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    randomise_norms(model)
    return model, tokenizer


def tiny_vlm(num_layers: int = 6, seed: int = 0, sliding_window: int = 8, image_size: int = 32):
    """Gemma3ForConditionalGeneration (SigLIP tower, 4 image tokens) with random weights; (model, processor)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = word_tokenizer()
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    text = _tiny_text_config(len(tokenizer), num_layers, sliding_window, pad_token_id=tokenizer.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=image_size, patch_size=8)
    config = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_id=tokenizer.image_token_id, boi_token_id=tokenizer.boi_token_id, eoi_token_id=tokenizer.eoi_token_id,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    randomise_norms(model)
    with torch.no_grad():  # the projector starts at zero: a random start makes the image matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=GEMMA_CHAT_TEMPLATE, image_seq_length=4)
    return model, processor
