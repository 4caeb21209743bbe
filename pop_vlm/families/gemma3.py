"""Gemma-3: sliding-window and global layers with their own RoPE, (1 + w) RMSNorm, soft-capped logits, and a
bidirectional attention block over each image's tokens (VLM)."""
from __future__ import annotations

import torch
from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, get_block_sequence_ids_for_mask

from .base import FamilyAdapter, Prompt, _single_sequence


class Gemma3Adapter(FamilyAdapter):
    name = "gemma-3"
    architectures = ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM")
    norm_weight_offset = 1.0
    bidirectional_image_blocks = True

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
