"""Qwen3-VL: interleaved M-RoPE with 3-D positions, and deepstack visual features after the first layers."""
from __future__ import annotations

import torch

from .base import FamilyAdapter, Prompt, _single_sequence


class Qwen3VLAdapter(FamilyAdapter):
    name = "qwen3-vl"
    architectures = ("Qwen3VLForConditionalGeneration",)

    def _find_decoder(self, model):
        return model.model.language_model

    @property
    def is_multimodal(self) -> bool:
        return True

    @property
    def image_token_id(self) -> int:
        return self.model.config.image_token_id

    @property
    def protected_layers(self) -> frozenset[int]:
        # Deepstack features of the vision tower are added to the outputs of layers 0..n-1.
        return frozenset(range(len(self.model.config.vision_config.deepstack_visual_indexes)))

    def encode(self, inputs: dict, start: int = 0) -> Prompt:
        input_ids = _single_sequence(inputs)
        outer = self.model.model
        embeds = self.decoder.embed_tokens(input_ids)
        pixel_values = inputs.get("pixel_values")
        image_mask, extras = None, {}
        if pixel_values is not None and start > 0 and not bool((input_ids[0, start:] == self.image_token_id).any()):
            image_mask = input_ids == self.image_token_id  # images already in the cache: no vision work
            grid = inputs["image_grid_thw"]
            token_types = inputs.get("mm_token_type_ids")
            positions, deltas = outer.get_rope_index(input_ids, image_mask.int() if token_types is None else token_types,
                                                     image_grid_thw=grid)
        elif pixel_values is not None:
            grid = inputs["image_grid_thw"]
            features = outer.get_image_features(pixel_values, grid, return_dict=True)
            image_embeds = torch.cat(features.pooler_output, dim=0).to(embeds.dtype)
            image_mask = input_ids == self.image_token_id
            if int(image_mask.sum()) != image_embeds.shape[0]:
                raise ValueError(
                    f"the prompt has {int(image_mask.sum())} image tokens but the image gives "
                    f"{image_embeds.shape[0]} features"
                )
            embeds = embeds.masked_scatter(image_mask[..., None], image_embeds)
            extras["deepstack"] = [torch.cat(f, dim=0).to(embeds.dtype) for f in features.deepstack_features]
            token_types = inputs.get("mm_token_type_ids")
            if token_types is None:
                token_types = image_mask.int()
            positions, deltas = outer.get_rope_index(input_ids, token_types, image_grid_thw=grid)
        else:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).view(1, 1, -1).expand(3, 1, -1)
            deltas = torch.zeros(1, 1, dtype=torch.long, device=input_ids.device)
        extras["rope_delta"] = int(deltas.view(-1)[0])
        return Prompt(input_ids=input_ids, embeds=embeds, positions=positions, image_mask=image_mask, extras=extras)

    def decode_positions(self, prompt: Prompt, index: int, length: int = 1) -> torch.Tensor:
        start = index + prompt.extras.get("rope_delta", 0)
        return torch.arange(start, start + length, device=prompt.input_ids.device).view(1, 1, -1).expand(3, 1, -1)

    def after_layer(self, index, hidden, prompt, span):
        deepstack = prompt.extras.get("deepstack") if (prompt is not None and span is not None) else None
        if not deepstack or index >= len(deepstack):
            return hidden
        start, end = span
        mask = prompt.image_mask[:, start:end]
        if not bool(mask.any()):
            return hidden
        # rows of the deepstack features that belong to image tokens inside this span
        image_index = torch.cumsum(prompt.image_mask[0].long(), 0) - 1
        rows = image_index[start:end][mask[0]]
        hidden = hidden.clone()
        hidden[mask] = hidden[mask] + deepstack[index][rows]
        return hidden
