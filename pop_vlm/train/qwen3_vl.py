"""Qwen3-VL builder of the training code: the `shapes-qwen3-vl` demo model's processor, config and packed inputs.

A family builder answers what the shared loop, data, export and model card need to know about one architecture:
its tokenizer and processor, its config from the command's sizes, a fresh model, how several questions about one
image are packed into one row (`Encoder`), and the family's sections of the model card.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import shapes as S
from ..offline_tokenizers import QWEN3_VL_CHAT_TEMPLATE, QWEN_SPECIALS, shapes_qwen3_vl_tokenizer
from .packing import answer_logits, check_packing

FAMILY = "qwen3-vl"
MODEL_NAME = "shapes-qwen3-vl"
CHAT_TEMPLATE = QWEN3_VL_CHAT_TEMPLATE
EOS_TOKEN = "<|im_end|>"


def build_image_processor(max_pixels: int, min_pixels: int, patch_size: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_processor(args, tokenizer=None):
    """Image-only Qwen3-VL processor: native dynamic resolution within ``args.max_pixels``, the demo tokenizer."""
    from ..processors import ImageOnlyQwen3VLProcessor

    tokenizer = tokenizer or shapes_qwen3_vl_tokenizer()
    return ImageOnlyQwen3VLProcessor(
        image_processor=build_image_processor(args.max_pixels, args.min_pixels, args.patch_size),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(args, tokenizer):
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    vocab_size = int(math.ceil(len(tokenizer) / 16) * 16)
    head_dim = args.text_head_dim
    half = head_dim // 2
    t_sec = half - 2 * (half * 5 // 16)  # Qwen3-VL splits 64 as [24, 20, 20]
    mrope_section = [t_sec, half * 5 // 16, half * 5 // 16]
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=args.text_width,
        intermediate_size=args.text_ffn,
        num_hidden_layers=args.text_layers,
        num_attention_heads=args.text_width // head_dim,
        num_key_value_heads=max(1, args.text_width // head_dim // 2),
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=mrope_section, mrope_interleaved=True),
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
    )
    depth = args.vision_layers
    deepstack = list(range(depth - 1))[-2:] if depth > 1 else []
    vision_config = dict(
        depth=depth,
        hidden_size=args.vision_width,
        intermediate_size=args.vision_width * 4,
        num_heads=args.vision_width // 32,
        in_channels=3,
        patch_size=args.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=args.text_width,
        num_position_embeddings=args.vision_pos_grid**2,
        deepstack_visual_indexes=deepstack,
        hidden_act="gelu_pytorch_tanh",
    )
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.pad_token_id = ids["<|endoftext|>"]
    config.eos_token_id = ids["<|im_end|>"]
    return config


def new_model(config):
    """A randomly initialised model (draws from torch's global generator); SDPA attention."""
    from transformers import Qwen3VLForConditionalGeneration

    config.text_config._attn_implementation = "sdpa"
    return Qwen3VLForConditionalGeneration(config)


def text_width(config) -> int:
    return config.text_config.hidden_size


def text_layers(model):
    return model.model.language_model.layers


def generation_config(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN), pad_token_id=tokenizer.pad_token_id,
        do_sample=False, max_new_tokens=8,
    )


def prepare_for_training(model, processor, enc):
    """Check the encoder and the packing against the processor and the model's own forward, then speed up the
    patch embedding (and check the packing again)."""
    probe = S.sample_scene(1)
    enc.check_against_processor(S.render(probe), S.questions(probe, 1)[0][0])
    check_packing(model, processor, enc)
    fast_patch_embed(model)
    check_packing(model, processor, enc)


def fast_patch_embed(model):
    """Run the vision patch embedding (a Conv3d whose stride equals its kernel) as one matmul.

    Same function and parameters, several times faster on CPU; only the training process is patched."""
    embed = model.model.visual.patch_embed

    def forward(hidden_states):
        weight = embed.proj.weight
        flat = hidden_states.view(-1, weight[0].numel()).to(weight.dtype)
        return F.linear(flat, weight.view(weight.shape[0], -1), embed.proj.bias)

    embed.forward = forward


class Encoder:
    """Builds model inputs for (image, question[, answer]) without re-running the processor per question."""

    def __init__(self, processor):
        self.processor = processor
        self.tok = processor.tokenizer
        self.ip = processor.image_processor
        self.merge = self.ip.merge_size
        self.image_id = self.tok.convert_tokens_to_ids("<|image_pad|>")
        self.pad_id = self.tok.pad_token_id
        self.eos_id = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.head = list(self.tok("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)["input_ids"])
        self.vision_end = self.tok.convert_tokens_to_ids("<|vision_end|>")
        self.tail = list(self.tok("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
        self._cache: dict[str, list[int]] = {}
        self.answer_ids = {a: self.word_ids(a)[0] for a in S.ANSWERS}

    def word_ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = list(self.tok(text, add_special_tokens=False)["input_ids"])
        return self._cache[text]

    def images(self, images):
        out = self.ip(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def n_tokens(self, grid_thw) -> int:
        return int(grid_thw.prod()) // (self.merge**2)

    def prompt(self, question: str, n_image_tokens: int) -> list[int]:
        return self.head + [self.image_id] * n_image_tokens + [self.vision_end] + self.word_ids(question) + self.tail

    def check_against_processor(self, image, question):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        ref = self.processor(text=[text], images=[image], return_tensors="pt")
        _, grid = self.images([image])
        mine = self.prompt(question, self.n_tokens(grid[0]))
        assert ref["input_ids"][0].tolist() == mine, (ref["input_ids"][0].tolist(), mine)

    def pack(self, model, grid, seqs, with_answer: bool):
        """Pack every image's questions into one sequence that shares the image prefix.

        ``seqs`` = [(image_index, question, answer, qtype)]. Row ``i`` of the batch holds image ``i``'s prefix
        ``<|im_start|>user<|vision_start|><|image_pad|>*n<|vision_end|>`` followed by one block per question
        (``{question}<|im_end|><|im_start|>assistant`` [+ ``{answer}<|im_end|>``]). A 4D attention mask lets each
        block see the prefix and itself only, and each block gets the positions it would have right after the
        prefix, so the result is exactly that of one sequence per question, while the image tokens are
        processed once. Returns input ids, the 4D mask, M-RoPE position ids (3, batch, length) and, per
        question, (row, index of the logits that predict the answer, answer ids or None).
        """
        groups: dict[int, list] = {}
        for img, question, answer, _ in seqs:
            groups.setdefault(img, []).append((question, answer))
        if list(groups) != list(range(len(groups))):
            raise ValueError("every image needs at least one question, in image order")
        rows, spans, positions, targets = [], [], [], []
        for row, items in groups.items():
            ids = self.head + [self.image_id] * self.n_tokens(grid[row]) + [self.vision_end]
            prefix_ids = torch.tensor([ids])
            pos, _ = model.model.get_rope_index(prefix_ids, (prefix_ids == self.image_id).int(), grid[row : row + 1])
            pos = [pos[:, 0]]
            next_pos = int(pos[0].max()) + 1
            blocks = []
            for question, answer in items:
                block = self.word_ids(question) + self.tail
                if with_answer:
                    block = block + [self.answer_ids[answer], self.eos_id]
                start = len(ids)
                ids = ids + block
                blocks.append((start, len(block)))
                pos.append((torch.arange(len(block)) + next_pos).view(1, -1).expand(3, -1))
                answer_at = start + len(self.word_ids(question)) + len(self.tail) - 1
                targets.append((row, answer_at, [self.answer_ids[answer], self.eos_id] if with_answer else None))
            rows.append(ids)
            spans.append((len(ids) - sum(b[1] for b in blocks), blocks))
            positions.append(torch.cat(pos, dim=1))
        input_ids, mask, position_ids = self._collate(rows, spans, positions)
        return input_ids, mask, position_ids, targets

    def _collate(self, rows, spans, positions):
        """Pad the packed rows; each block attends causally to itself and to its row's prefix."""
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        position_ids = torch.zeros((3, len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), 1, width, width), dtype=torch.bool)
        mask[:, 0] = torch.eye(width, dtype=torch.bool)  # padding attends to itself only (no NaNs)
        for r, (ids, (prefix, blocks)) in enumerate(zip(rows, spans)):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            position_ids[:, r, : len(ids)] = positions[r]
            mask[r, 0, :prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
            for start, length in blocks:
                mask[r, 0, start : start + length, :prefix] = True
                mask[r, 0, start : start + length, start : start + length] = torch.ones(length, length, dtype=torch.bool).tril()
        return input_ids, mask, position_ids

    @staticmethod
    def forward_hidden(model, pixel_values, grid, input_ids, mask, position_ids):
        """Run the vision tower once per image and the language model on packed rows (one row per image).

        Returns the language model's last hidden states and the merged vision features of every image."""
        vis = model.model.get_image_features(pixel_values, grid, return_dict=True)
        out = model.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
            mm_encoder_outputs={"image": vis},
            use_cache=False,
        )
        return out.last_hidden_state, vis.pooler_output

    answer_logits = staticmethod(answer_logits)


# ---- the family's sections of the model card --------------------------------------------------------------------
def card_intro() -> list[str]:
    return [
        "A tiny Qwen3-VL model (`Qwen3VLForConditionalGeneration`) trained from scratch on the synthetic shapes",
        "visual question answering task of `pop_vlm.shapes`. It is the demo model of pop-vlm: small enough for",
        "CPU tests, but a real Qwen3-VL architecture (dynamic-resolution vision tower with 2x2 patch merging,",
        "DeepStack, interleaved M-RoPE) that actually looks at the image.",
    ]


def card_model(config, processor, args, info) -> list[str]:
    """The "Model" section: sizes, image processing, parameters, special tokens and the prompt format."""
    tok, ip = processor.tokenizer, processor.image_processor
    tc, vc = config.text_config, config.vision_config
    return [
        f"* text: {tc.num_hidden_layers} layers, width {tc.hidden_size}, FFN {tc.intermediate_size}, "
        f"{tc.num_attention_heads} heads ({tc.num_key_value_heads} KV) of {tc.head_dim}, "
        f"M-RoPE sections {tc.rope_parameters['mrope_section']} (interleaved), vocabulary {tc.vocab_size}",
        f"* vision: {vc.depth} layers, width {vc.hidden_size}, patch {vc.patch_size}, 2x2 merge, "
        f"DeepStack from vision layers {list(vc.deepstack_visual_indexes)}",
        f"* image processor: min_pixels {ip.size['shortest_edge']}, max_pixels {ip.size['longest_edge']} "
        f"(at most {ip.size['longest_edge'] // (ip.patch_size * 2) ** 2} vision tokens per image, "
        f"e.g. {(224 // 32) ** 2} at 224x224)",
        f"* parameters: {info['params']:,}; weights: {info['size_mb']:.1f} MB safetensors, stored as "
        f"{'bfloat16' if args.export_dtype == 'bf16' else 'float32'} (loads as float32 on CPU by default)",
        f"* special tokens: pad `<|endoftext|>`={tok.pad_token_id}, "
        + ", ".join(f"`{t}`={tok.convert_tokens_to_ids(t)}" for t in QWEN_SPECIALS[1:7])
        + "; generation stops on `<|im_end|>`",
        "",
        "Prompt format (the processor's chat template):",
        "",
        "```",
        "<|im_start|>user",
        "<|vision_start|><|image_pad|><|vision_end|>What color is the circle?<|im_end|>",
        "<|im_start|>assistant",
        "red<|im_end|>",
        "```",
    ]


def card_use() -> list[str]:
    return [
        "from transformers import Qwen3VLForConditionalGeneration",
        "from pop_vlm.processors import load_qwen3_vl_processor",
        "from pop_vlm import shapes",
        "",
        f'processor = load_qwen3_vl_processor("assets/models/{MODEL_NAME}")',
        f'model = Qwen3VLForConditionalGeneration.from_pretrained("assets/models/{MODEL_NAME}")',
    ]
