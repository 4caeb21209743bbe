"""Qwen3-VL: interleaved M-RoPE with 3-D positions, and deepstack visual features after the first layers."""
from __future__ import annotations

import torch

from ..offline_tokenizers import QWEN3_VL_CHAT_TEMPLATE, qwen3_tokenizer
from ..scaling import scale_text, scale_vision_heads, scale_width
from .base import FamilyAdapter, Prompt, _single_sequence

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
SPECIAL_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


class Qwen3VLAdapter(FamilyAdapter):
    name = "qwen3-vl"
    architectures = (ARCHITECTURE,)
    vlm_architectures = (ARCHITECTURE,)
    image_input_keys = ("pixel_values", "image_grid_thw")

    # ---- before a model exists ------------------------------------------------------------------------------
    @classmethod
    def load_processor(cls, path, architecture: str, trust_remote_code: bool = False):
        from ..processors import load_qwen3_vl_processor

        return load_qwen3_vl_processor(path)

    @classmethod
    def bench_config(cls, spec: dict, scale: float, vocab: int | None):
        import transformers

        text = scale_text(spec["text_config"], scale, vocab)
        vision = dict(spec["vision_config"])
        if scale != 1.0:
            vision["hidden_size"], vision["num_heads"] = scale_vision_heads(vision["hidden_size"], vision["num_heads"], scale)
            vision["intermediate_size"] = scale_width(vision["intermediate_size"], scale)
        vision["out_hidden_size"] = text["hidden_size"]
        ids = {k: spec[k] for k in SPECIAL_IDS}
        if vocab:  # the special tokens move to the top of the shrunk vocabulary
            ids = {k: text["vocab_size"] - 1 - i for i, k in enumerate(ids)}
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision,
                                            tie_word_embeddings=text["tie_word_embeddings"], **ids)
        return config, {"image": ids["image_token_id"], "vision_start": ids["vision_start_token_id"],
                        "vision_end": ids["vision_end_token_id"]}

    @classmethod
    def bench_image_processor(cls, model):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vision = model.config.vision_config
        return Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
            size={"shortest_edge": 65536, "longest_edge": 16777216},  # Qwen3-VL's preprocessor_config.json
        )

    @classmethod
    def bench_processor(cls, model):
        from ..processors import ImageOnlyQwen3VLProcessor

        tokenizer = qwen3_tokenizer()
        if model.config.text_config.vocab_size < len(tokenizer):
            raise ValueError("the Qwen3 tokenizer needs the real vocabulary: build the model with vocab=None")
        return ImageOnlyQwen3VLProcessor(image_processor=cls.bench_image_processor(model), tokenizer=tokenizer,
                                         video_processor=None, chat_template=QWEN3_VL_CHAT_TEMPLATE)

    @classmethod
    def bench_prompt_ids(cls, model, special, head, tail, pixels):
        if pixels is None:
            return head + tail
        # one token per merged 2x2 patch group
        n_image = int(pixels["image_grid_thw"].prod()) // model.config.vision_config.spatial_merge_size ** 2
        return head + [special["vision_start"]] + [special["image"]] * n_image + [special["vision_end"]] + tail

    @classmethod
    def tiny_models(cls) -> dict:
        return {"tiny-qwen3-vl": tiny_model}

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


def tiny_model(num_layers: int = 6, seed: int = 0, max_pixels: int = 64 * 64 * 4, deepstack: int = 2):
    """Qwen3-VL with random weights and the real Qwen3 tokenizer; returns (model, processor)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..processors import ImageOnlyQwen3VLProcessor

    tokenizer = qwen3_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True),
            tie_word_embeddings=True, initializer_range=0.2,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=list(range(deepstack)),
            num_position_embeddings=64,
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = ids("<|im_end|>")
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 32 * 32, "longest_edge": max_pixels},
    )
    processor = ImageOnlyQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=QWEN3_VL_CHAT_TEMPLATE
    )
    return model, processor
