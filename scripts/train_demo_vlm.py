#!/usr/bin/env python
"""Train the bundled demo VLM: a tiny Qwen3-VL model, from scratch, on the synthetic shapes task.

The model is a ``Qwen3VLForConditionalGeneration`` with a small vision tower (native dynamic resolution:
the processor keeps each canvas's aspect ratio and resizes it within ``--max-pixels``), a word-level
tokenizer with the Qwen chat special tokens, and the Qwen chat format::

    <|im_start|>user\\n<|vision_start|><|image_pad|>...<|vision_end|>{question}<|im_end|>\\n<|im_start|>assistant\\n
    {answer}<|im_end|>

Training is seeded and resumable: a checkpoint is written every few minutes to
``$XDG_CACHE_HOME/pop-vlm/train/shapes-qwen3-vl/`` (default ``~/.cache``) and picked up again by the next
run with the same output folder. Every ``--eval-every`` minutes the model is scored on a fixed held-out
set; every ``--export-every`` minutes the best model so far is exported with ``save_pretrained`` (plus
``model_card.md`` and ``training_curve.json``/``.png``) to ``assets/models/shapes-qwen3-vl/``.

What makes it learn quickly on a CPU:

* several questions per image: the vision tower runs once per image and its features are shared by
  all of that image's question sequences;
* an auxiliary dense loss on the vision tower: from every merged vision token (the features the language
  model receives) small linear heads predict the colour and the shape of the object under it (or
  background) and which half of the canvas it is in; the heads are not part of the exported model;
* a curriculum: first few, mostly large objects and mostly colour/count questions, then the full task;
* linear warm-up then cosine decay of the learning rate, AdamW, gradient clipping.

The loss on the language side covers only the answer token and the ``<|im_end|>`` after it.

Usage::

    python scripts/train_demo_vlm.py --minutes 150 --threads 1
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pop_vlm import shapes as S  # noqa: E402

MODEL_NAME = "shapes-qwen3-vl"
EXPORT_DIR = REPO / "assets" / "models" / MODEL_NAME
TEST_SET = REPO / "assets" / "qa" / "shapes_test.jsonl"
TRAIN_SEED_LIMIT = 900_000_000  # training scenes use seeds below this
VAL_SEED_START = 900_000_000  # held-out validation scenes (model selection); test scenes use seeds >= 1e9

SPECIAL_TOKENS = [
    "<|endoftext|>",  # padding
    "<|im_start|>",
    "<|im_end|>",  # end of turn, the generation's eos
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
]
CHAT_WORDS = ["system", "user", "assistant"]
PUNCTUATION = ["?", ".", ",", "!", ":", "'"]

# Renders a user turn as <|im_start|>user\n<image>...{text}<|im_end|>\n; content may be a string or a list
# of {"type": "image"|"video"|"text"} items; ends with <|im_start|>assistant\n for a generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


# ------------------------------------------------------------------------------------------ components


def task_words() -> list[str]:
    """Every word the task's questions and answers use."""
    words: list[str] = []
    for template in S.TEMPLATES.values():
        words += re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", template.lower()))
    return list(dict.fromkeys(words + list(S.ANSWERS)))


def build_tokenizer():
    """A word-level tokenizer (lower-cased, words and punctuation) with the Qwen chat special tokens."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(CHAT_WORDS + task_words() + PUNCTUATION))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        extra_special_tokens=["<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
        model_max_length=4096,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


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
    from pop_vlm.processors import ImageOnlyQwen3VLProcessor

    tokenizer = tokenizer or build_tokenizer()
    return ImageOnlyQwen3VLProcessor(
        image_processor=build_image_processor(args.max_pixels, args.min_pixels, args.patch_size),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(args, tokenizer):
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
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


def fast_patch_embed(model):
    """Run the vision patch embedding (a Conv3d whose stride equals its kernel) as one matmul.

    Same function and parameters, several times faster on CPU; only the training process is patched."""
    embed = model.model.visual.patch_embed

    def forward(hidden_states):
        weight = embed.proj.weight
        flat = hidden_states.view(-1, weight[0].numel()).to(weight.dtype)
        return F.linear(flat, weight.view(weight.shape[0], -1), embed.proj.bias)

    embed.forward = forward


class AuxHeads(torch.nn.Module):
    """Per-merged-token probes on the vision features: colour (or background), shape (or background),
    and which half of the canvas the token is in. Used only as a training signal."""

    def __init__(self, dim: int):
        super().__init__()
        self.color = torch.nn.Linear(dim, len(S.COLORS) + 1)
        self.shape = torch.nn.Linear(dim, len(S.SHAPES) + 1)
        self.lr_half = torch.nn.Linear(dim, 2)

    def forward(self, feats):
        return self.color(feats), self.shape(feats), self.lr_half(feats)


class WordHeads(torch.nn.Module):
    """Probes on the language model's hidden states at the colour and shape words of a question.

    At such a word the phrase so far ("red", or "red circle", or "circle") denotes a set of objects; the
    heads predict how many objects that is (0-4), where they are (none / all left / all right / other),
    and the colour and shape of the object when there is exactly one. This teaches the question words to
    look up their referents in the image one hop at a time. Used only as a training signal."""

    def __init__(self, dim: int):
        super().__init__()
        self.count = torch.nn.Linear(dim, 5)
        self.side = torch.nn.Linear(dim, 4)
        self.color = torch.nn.Linear(dim, len(S.COLORS) + 1)
        self.shape = torch.nn.Linear(dim, len(S.SHAPES) + 1)

    def forward(self, h):
        return self.count(h), self.side(h), self.color(h), self.shape(h)


def word_targets(scene, tokens: list[str]) -> list[tuple[int, tuple[int, int, int, int]]]:
    """(token index, (count, side, colour, shape)) for every colour or shape word of a question."""
    out, colour = [], None
    colors, shapes = list(S.COLORS), list(S.SHAPES)
    for i, tok in enumerate(tokens):
        if tok in colors:
            colour, refs = tok, [o for o in scene.objects if o.color == tok]
        elif tok in shapes:
            refs = [o for o in scene.objects if o.shape == tok and (colour is None or o.color == colour)]
        else:
            colour = None
            continue
        halves = {S._horizontal_half(o, scene.width) for o in refs}
        side = 0 if not refs else {frozenset(["left"]): 1, frozenset(["right"]): 2}.get(frozenset(halves), 3)
        one = refs[0] if len(refs) == 1 else None
        out.append((i, (len(refs), side, colors.index(one.color) + 1 if one else 0, shapes.index(one.shape) + 1 if one else 0)))
    return out


def word_supervision(enc, seqs, targets, scenes):
    """Batch positions (rows, cols) of the question's colour/shape words and their targets (n, 4)."""
    rows, cols, tgt = [], [], []
    for (img, question, _, _), (row, answer_at, _) in zip(seqs, targets):
        q_ids = enc.word_ids(question)
        start = answer_at - len(enc.tail) + 1 - len(q_ids)
        for off, t in word_targets(scenes[img], enc.tok.convert_ids_to_tokens(q_ids)):
            rows.append(row)
            cols.append(start + off)
            tgt.append(t)
    return torch.tensor(rows), torch.tensor(cols), torch.tensor(tgt, dtype=torch.long).view(-1, 4)


# ----------------------------------------------------------------------------------------------- data


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
        head = self.tok("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)["input_ids"]
        self.head = list(head)
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


def curriculum(images_seen: int, args) -> tuple[dict, dict]:
    """Scene sampler kwargs and question-type weights for the current point of training."""
    if images_seen < args.stage1_images:
        return (
            dict(min_objects=1, max_objects=2, large_prob=0.8),
            dict(color_of_shape=2.0, count=2.0, shape_of_color=1.0, exists=1.0, left_right=1.0),
        )
    if images_seen < args.stage2_images:
        return (
            dict(min_objects=1, max_objects=3, large_prob=0.6),
            dict(color_of_shape=1.0, count=1.0, shape_of_color=1.0, exists=1.0, left_right=1.0),
        )
    return (
        dict(min_objects=1, max_objects=4, large_prob=0.5),
        dict(color_of_shape=1.0, count=1.0, shape_of_color=1.2, exists=1.2, left_right=1.2),
    )


def aux_targets(scene, grid_thw, merge: int):
    rows, cols = int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    labels = S.label_grid(scene, rows, cols)
    color_ids = {c: i + 1 for i, c in enumerate(S.COLORS)}
    shape_ids = {s: i + 1 for i, s in enumerate(S.SHAPES)}
    color_lut = np.array([0] + [color_ids[o.color] for o in scene.objects])
    shape_lut = np.array([0] + [shape_ids[o.shape] for o in scene.objects])
    half = np.broadcast_to((np.arange(cols) + 0.5 >= cols / 2).astype(np.int64), (rows, cols))
    return (
        torch.from_numpy(color_lut[labels].reshape(-1)),
        torch.from_numpy(shape_lut[labels].reshape(-1)),
        torch.from_numpy(half.reshape(-1).copy()),
    )


def make_batch(step: int, images_seen: int, enc: Encoder, args):
    """Training batch for ``step``: a pure function of (seed, step, images_seen)."""
    rng = np.random.default_rng([args.seed, step])
    scene_kwargs, weights = curriculum(images_seen, args)
    scenes, qas = [], []
    for _ in range(args.images_per_step):
        seed = int(rng.integers(0, TRAIN_SEED_LIMIT))
        scene_rng = np.random.default_rng(seed)
        scene = S.sample_scene(scene_rng, **scene_kwargs)
        scenes.append(scene)
        qas.append(S.questions(scene, scene_rng, n=args.questions_per_image, qtype_weights=weights))
    pixel_values, grid = enc.images([S.render(s) for s in scenes])
    aux = [aux_targets(s, g, enc.merge) for s, g in zip(scenes, grid)]
    seqs = [(i, q, a, t) for i, qa in enumerate(qas) for (q, a, t) in qa]
    return pixel_values, grid, seqs, aux, scenes


def pack(model, enc: Encoder, grid, seqs, with_answer: bool):
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
        n_img = enc.n_tokens(grid[row])
        ids = enc.head + [enc.image_id] * n_img + [enc.vision_end]
        prefix_ids = torch.tensor([ids])
        pos, _ = model.model.get_rope_index(prefix_ids, (prefix_ids == enc.image_id).int(), grid[row : row + 1])
        pos = [pos[:, 0]]
        next_pos = int(pos[0].max()) + 1
        blocks = []
        for question, answer in items:
            block = enc.word_ids(question) + enc.tail
            if with_answer:
                block = block + [enc.answer_ids[answer], enc.eos_id]
            start = len(ids)
            ids = ids + block
            blocks.append((start, len(block)))
            pos.append((torch.arange(len(block)) + next_pos).view(1, -1).expand(3, -1))
            answer_at = start + len(enc.word_ids(question)) + len(enc.tail) - 1
            targets.append((row, answer_at, [enc.answer_ids[answer], enc.eos_id] if with_answer else None))
        rows.append(ids)
        spans.append((len(ids) - sum(b[1] for b in blocks), blocks))
        positions.append(torch.cat(pos, dim=1))
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), enc.pad_id, dtype=torch.long)
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
    return input_ids, mask, position_ids, targets


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


def answer_logits(model, hidden, targets, with_eos: bool):
    """Logits at the answer position of every question (and at the ``<|im_end|>`` one after it)."""
    offsets = (0, 1) if with_eos else (0,)
    rows = torch.tensor([t[0] for t in targets for _ in offsets])
    cols = torch.tensor([t[1] + k for t in targets for k in offsets])
    return model.lm_head(hidden[rows, cols]).float()


@torch.no_grad()
def check_packing(model, processor, enc: Encoder):
    """Packed logits must equal the model's own forward on processor outputs, one question at a time."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration  # noqa: F401

    was_training = model.training
    model.eval()
    scenes = [S.sample_scene(s) for s in (11, 12)]
    images = [S.render(sc) for sc in scenes]
    seqs = [(i, q, a, t) for i, sc in enumerate(scenes) for q, a, t in S.questions(sc, 5)[:3]]
    pixel_values, grid = enc.images(images)
    device = next(model.parameters()).device
    input_ids, mask, position_ids, targets = pack(model, enc, grid, seqs, with_answer=True)
    hidden, _ = forward_hidden(model, pixel_values.to(device), grid.to(device), input_ids.to(device), mask.to(device), position_ids.to(device))
    packed = answer_logits(model, hidden, targets, with_eos=False)
    for k, (img, question, _, _) in enumerate(seqs):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=[images[img]], return_tensors="pt").to(device)
        ref = model(**inputs).logits[0, -1].float()
        torch.testing.assert_close(packed[k], ref, rtol=1e-3, atol=1e-3)
    model.train(was_training)


# ------------------------------------------------------------------------------------------ evaluation


class EvalSet:
    """A fixed list of records with their preprocessed images, scored by greedy next-token prediction."""

    def __init__(self, records, enc: Encoder):
        self.records = records
        self.enc = enc
        self.items = []
        for rec in records:
            image, question, answer = S.sample_from_record(rec)
            pixel_values, grid = enc.images([image])
            self.items.append((pixel_values, grid, question, answer))

    @torch.no_grad()
    def predict(self, model, batch: int = 32) -> list[str]:
        model.eval()
        preds = []
        for start in range(0, len(self.items), batch):
            chunk = self.items[start : start + batch]
            pixel_values = torch.cat([c[0] for c in chunk])
            grid = torch.cat([c[1] for c in chunk])
            seqs = [(i, c[2], c[3], "") for i, c in enumerate(chunk)]
            device = next(model.parameters()).device
            input_ids, mask, position_ids, targets = pack(model, self.enc, grid, seqs, with_answer=False)
            hidden, _ = forward_hidden(
                model, pixel_values.to(device), grid.to(device), input_ids.to(device), mask.to(device), position_ids.to(device)
            )
            logits = answer_logits(model, hidden, targets, with_eos=False)
            preds += [self.enc.tok.decode([int(t)]) for t in logits.argmax(-1)]
        model.train()
        return preds

    def report(self, preds) -> dict:
        by_type, by_canvas, by_w, by_h = (defaultdict(list) for _ in range(4))
        for rec, pred in zip(self.records, preds):
            ok = S.score(pred, rec["answer"])
            by_type[rec["qtype"]].append(ok)
            by_canvas[f"{rec['width']}x{rec['height']}"].append(ok)
            by_w[rec["width"]].append(ok)
            by_h[rec["height"]].append(ok)
        mean = lambda v: float(np.mean(v)) if v else float("nan")  # noqa: E731
        allv = [x for v in by_type.values() for x in v]
        return {
            "accuracy": mean(allv),
            "n": len(allv),
            "by_qtype": {q: mean(by_type[q]) for q in S.QTYPES if by_type[q]},
            "n_by_qtype": {q: len(by_type[q]) for q in S.QTYPES if by_type[q]},
            "by_canvas": {k: mean(v) for k, v in sorted(by_canvas.items())},
            "by_width": {k: mean(v) for k, v in sorted(by_w.items())},
            "by_height": {k: mean(v) for k, v in sorted(by_h.items())},
        }


def load_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# ------------------------------------------------------------------------------------------- training


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pop-vlm" / "train" / MODEL_NAME


def lr_at(step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def log(msg: str, path: Path | None = None):
    line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}"
    print(line, flush=True)
    if path is not None:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def save_checkpoint(path: Path, state: dict):
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def export(model_state, config, processor, args, info: dict, curve: list, test_report: dict | None):
    """Write the best model so far to ``args.export_dir`` (atomically replaced)."""
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    out = Path(args.export_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = Qwen3VLForConditionalGeneration(config)
    model.load_state_dict(model_state)
    if args.export_dtype == "bf16":
        model = model.to(torch.bfloat16)
    tok = processor.tokenizer
    model.generation_config = GenerationConfig(
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=8,
    )
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    with open(tmp / "chat_template.jinja", "w", encoding="utf-8") as handle:
        handle.write(CHAT_TEMPLATE)
    size_mb = sum(f.stat().st_size for f in tmp.glob("*.safetensors")) / 1e6
    info = dict(info, size_mb=round(size_mb, 2))
    with open(tmp / "training_curve.json", "w", encoding="utf-8") as handle:
        json.dump({"info": info, "curve": curve}, handle, indent=1)
    plot_curve(curve, tmp / "training_curve.png")
    with open(tmp / "model_card.md", "w", encoding="utf-8") as handle:
        handle.write(model_card(config, processor, args, info, test_report))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return size_mb


def plot_curve(curve, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    evals = [c for c in curve if "val_accuracy" in c]
    losses = [c for c in curve if "loss" in c]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([c["images"] for c in losses], [c["loss"] for c in losses], label="answer loss")
    ax[0].plot([c["images"] for c in losses], [c["aux_loss"] for c in losses], label="vision aux loss")
    ax[0].set_xlabel("training images")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[1].plot([c["images"] for c in evals], [c["val_accuracy"] for c in evals], label="all", lw=2)
    for q in S.QTYPES:
        ax[1].plot([c["images"] for c in evals], [c["val_by_qtype"].get(q, float("nan")) for c in evals], label=q)
    ax[1].set_xlabel("training images")
    ax[1].set_ylabel("held-out accuracy")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def model_card(config, processor, args, info, test_report) -> str:
    tok = processor.tokenizer
    ip = processor.image_processor
    tc, vc = config.text_config, config.vision_config
    lines = [
        f"# {MODEL_NAME}",
        "",
        "A tiny Qwen3-VL model (`Qwen3VLForConditionalGeneration`) trained from scratch on the synthetic shapes",
        "visual question answering task of `pop_vlm.shapes`. It is the demo model of pop-vlm: small enough for",
        "CPU tests, but a real Qwen3-VL architecture (dynamic-resolution vision tower with 2x2 patch merging,",
        "DeepStack, interleaved M-RoPE) that actually looks at the image.",
        "",
        "## Task",
        "",
        "Canvases of 224-896 px per side (white, light grey or light noise background) with 1-4 non-overlapping",
        "circles, squares and triangles in six colours, small (10-15% of the shorter side) or large (25-35%).",
        "Questions (one-word answers): `What color is the {shape}?`, `What shape is the {color} object?`,",
        "`How many shapes are there?`, `Is there a {color} {shape}?`, `Is the {color} {shape} on the left or",
        "the right?`. Scoring: exact match after lower-casing and removing spaces and punctuation.",
        "",
        "## Data",
        "",
        f"Scenes are generated on the fly (training seeds < {TRAIN_SEED_LIMIT:,}; model selection on "
        f"{args.val_size} held-out scenes with seeds from {VAL_SEED_START:,}; the test set "
        "`assets/qa/shapes_test.jsonl` uses seeds >= 1,000,000,000). Curriculum: first up to 2 mostly large",
        f"objects ({args.stage1_images:,} images), then up to 3 ({args.stage2_images:,}), then the full task. "
        f"{args.questions_per_image} questions per image.",
        "",
        "## Model",
        "",
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
        + ", ".join(f"`{t}`={tok.convert_tokens_to_ids(t)}" for t in SPECIAL_TOKENS[1:7])
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
        "",
        "## Training",
        "",
        "```",
        info["command"],
        "```",
        "",
        f"Trained on {info['device']} ({info['threads']} thread(s)) for {info['total_minutes']:.0f} minutes and "
        f"{info['total_images']:,} images by the time of this export. The exported weights are those with the best "
        f"held-out accuracy ({info['val_accuracy']:.3f}), reached at step {info['step']:,} after {info['images']:,} "
        f"images and {info['train_minutes']:.0f} minutes of training.",
        "Loss: cross-entropy on the answer token and `<|im_end|>` only, plus two auxiliary losses whose small",
        "heads are not exported: per merged vision token, the colour and shape of the object under it (or",
        "background) and its canvas half, from the vision features; and at each colour or shape word of a",
        "question, the number, side, colour and shape of the objects the phrase so far refers to, from the",
        f"output of text layer {args.word_layer}.",
        "AdamW, linear warm-up then cosine decay. `training_curve.json` holds the loss and held-out",
        "accuracy over training.",
        "",
    ]
    if test_report:
        lines += [
            f"## Accuracy on `assets/qa/shapes_test.jsonl` ({test_report['n']} questions, greedy)",
            "",
            f"Overall: **{test_report['accuracy']:.3f}**",
            "",
            "| question type | n | accuracy |",
            "|---|---|---|",
        ]
        for q, acc in test_report["by_qtype"].items():
            lines.append(f"| {q} | {test_report['n_by_qtype'][q]} | {acc:.3f} |")
        lines += ["", "By canvas size (rows: height, columns: width):", ""]
        lines.append("| h \\ w | " + " | ".join(str(w) for w in S.CANVAS_SIZES) + " | all |")
        lines.append("|---" * (len(S.CANVAS_SIZES) + 2) + "|")
        for h in S.CANVAS_SIZES:
            cells = [test_report["by_canvas"].get(f"{w}x{h}", float("nan")) for w in S.CANVAS_SIZES]
            lines.append(
                f"| {h} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {test_report['by_height'].get(h, float('nan')):.2f} |"
            )
        lines.append(
            "| all | " + " | ".join(f"{test_report['by_width'].get(w, float('nan')):.2f}" for w in S.CANVAS_SIZES) + " | |"
        )
        lines.append("")
    lines += [
        "## Use",
        "",
        "```python",
        "from transformers import Qwen3VLForConditionalGeneration",
        "from pop_vlm.processors import load_qwen3_vl_processor",
        "from pop_vlm import shapes",
        "",
        f'processor = load_qwen3_vl_processor("assets/models/{MODEL_NAME}")',
        f'model = Qwen3VLForConditionalGeneration.from_pretrained("assets/models/{MODEL_NAME}")',
        "image, question, answer = shapes.sample_from_record(record)  # a line of shapes_test.jsonl",
        'messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]',
        "text = processor.apply_chat_template(messages, add_generation_prompt=True)",
        'inputs = processor(text=[text], images=[image], return_tensors="pt")',
        "out = model.generate(**inputs, max_new_tokens=4, do_sample=False)",
        'pred = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)',
        "```",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=150.0, help="wall-clock budget of this run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-every", type=float, default=10.0, help="minutes between exports of the best model")
    p.add_argument("--eval-every", type=float, default=5.0, help="minutes between held-out evaluations")
    p.add_argument("--checkpoint-every", type=float, default=5.0, help="minutes between checkpoints")
    p.add_argument("--out-dir", default=None, help=f"checkpoints and log (default: {cache_dir()})")
    p.add_argument("--export-dir", default=str(EXPORT_DIR))
    p.add_argument("--export-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--profile", type=int, default=0, help="time this many steps and exit")
    # data
    p.add_argument("--images-per-step", type=int, default=8)
    p.add_argument("--questions-per-image", type=int, default=6)
    p.add_argument("--stage1-images", type=int, default=4000)
    p.add_argument("--stage2-images", type=int, default=14000)
    p.add_argument("--val-size", type=int, default=250)
    p.add_argument("--test-size", type=int, default=0, help="test records scored at export (0: all)")
    # image processing
    p.add_argument("--patch-size", type=int, default=16)
    p.add_argument("--max-pixels", type=int, default=144 * 32 * 32)
    p.add_argument("--min-pixels", type=int, default=4 * 32 * 32)
    # model
    p.add_argument("--text-layers", type=int, default=6)
    p.add_argument("--text-width", type=int, default=192)
    p.add_argument("--text-ffn", type=int, default=512)
    p.add_argument("--text-head-dim", type=int, default=32)
    p.add_argument("--vision-layers", type=int, default=3)
    p.add_argument("--vision-width", type=int, default=128)
    p.add_argument("--vision-pos-grid", type=int, default=32)
    # optimisation
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--total-steps", type=int, default=5000, help="length of the LR schedule")
    p.add_argument("--aux-weight", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--word-weight", type=float, default=0.5, help="weight of the question-word referent loss")
    p.add_argument("--word-layer", type=int, default=2, help="decoder layer whose output the word heads read")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_dir = Path(args.out_dir) if args.out_dir else cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = None if args.profile else out_dir / "train.log"
    ckpt_path = out_dir / "last.pt"
    command = "python scripts/train_demo_vlm.py " + " ".join(sys.argv[1:] if argv is None else argv)

    torch.manual_seed(args.seed)
    processor = build_processor(args)
    enc = Encoder(processor)
    config = build_config(args, processor.tokenizer)
    config.text_config._attn_implementation = "sdpa"
    model = Qwen3VLForConditionalGeneration(config).to(device)
    aux = AuxHeads(config.text_config.hidden_size).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [
            {"params": decay + list(aux.parameters()), "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    word_heads = WordHeads(config.text_config.hidden_size).to(device)
    word_opt = torch.optim.AdamW(word_heads.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    probe_hidden = {}
    model.model.language_model.layers[args.word_layer].register_forward_hook(
        lambda module, inputs, output: probe_hidden.__setitem__("h", output[0] if isinstance(output, tuple) else output)
    )
    probe = S.sample_scene(1)
    enc.check_against_processor(S.render(probe), S.questions(probe, 1)[0][0])
    check_packing(model, processor, enc)
    fast_patch_embed(model)
    check_packing(model, processor, enc)

    state = dict(step=0, images=0, train_seconds=0.0, curve=[], best=None, best_acc=-1.0, best_info=None, exported_step=-1)
    if ckpt_path.exists() and not args.fresh and not args.profile:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ckpt["model"])
        aux.load_state_dict(ckpt["aux"])
        if "word_heads" in ckpt:
            word_heads.load_state_dict(ckpt["word_heads"])
            word_opt.load_state_dict(ckpt["word_opt"])
        opt.load_state_dict(ckpt["opt"])
        state = ckpt["state"]
        log(f"resumed from {ckpt_path} at step {state['step']} ({state['images']} images)", log_path)
    else:
        log(f"new run: {n_params:,} parameters; {command}", log_path)

    val = EvalSet(S.make_records(range(VAL_SEED_START, VAL_SEED_START + args.val_size), S.QTYPES), enc)
    test_records = load_jsonl(TEST_SET) if TEST_SET.exists() else []
    if args.test_size:
        test_records = test_records[: args.test_size]
    test = EvalSet(test_records, enc) if test_records and not args.profile else None

    def snapshot_info():
        return dict(
            command=command,
            step=state["step"],
            images=state["images"],
            train_minutes=state["train_seconds"] / 60,
            device=str(device),
            threads=args.threads,
            params=n_params,
        )

    def do_export():
        if state["best"] is None or state["exported_step"] == state["best_info"]["step"]:
            return
        best_model = Qwen3VLForConditionalGeneration(config)
        best_model.load_state_dict(state["best"])
        report = test.report(test.predict(best_model)) if test else None
        info = dict(state["best_info"], total_minutes=state["train_seconds"] / 60, total_images=state["images"])
        if report:
            info["test_accuracy"] = report["accuracy"]
            info["test_by_qtype"] = report["by_qtype"]
        size = export(state["best"], config, processor, args, info, state["curve"], report)
        state["exported_step"] = state["best_info"]["step"]
        test_msg = f" test={report['accuracy']:.3f} {json.dumps({k: round(v, 3) for k, v in report['by_qtype'].items()})}" if report else ""
        log(f"exported step {state['exported_step']} ({size:.1f} MB) to {args.export_dir};{test_msg}", log_path)

    model.train()
    start = time.time()
    last_eval = last_export = last_ckpt = time.time()
    window = defaultdict(list)
    while True:
        now = time.time()
        if args.profile and state["step"] >= args.profile:
            break
        if not args.profile and now - start > args.minutes * 60:
            break
        t0 = time.time()
        pixel_values, grid, seqs, aux_t, scenes = make_batch(state["step"], state["images"], enc, args)
        t_data = time.time() - t0
        input_ids, mask, position_ids, targets = pack(model, enc, grid, seqs, with_answer=True)
        lr = lr_at(state["step"], args)
        for group in opt.param_groups:
            group["lr"] = lr
        hidden, vis_feats = forward_hidden(
            model, pixel_values.to(device), grid.to(device), input_ids.to(device), mask.to(device), position_ids.to(device)
        )
        logits = answer_logits(model, hidden, targets, with_eos=True)
        labels = torch.tensor([a for t in targets for a in t[2]], device=device)
        answer_loss = F.cross_entropy(logits, labels)
        feats = torch.cat(vis_feats)
        c_logit, s_logit, h_logit = aux(feats)
        c_t, s_t, h_t = (torch.cat([a[k] for a in aux_t]).to(device) for k in range(3))
        aux_loss = (
            F.cross_entropy(c_logit.float(), c_t) + F.cross_entropy(s_logit.float(), s_t) + 0.5 * F.cross_entropy(h_logit.float(), h_t)
        )
        w_rows, w_cols, w_t = word_supervision(enc, seqs, targets, scenes)
        w_logits = word_heads(probe_hidden["h"][w_rows, w_cols])
        w_t = w_t.to(device)
        word_loss = sum(F.cross_entropy(lg.float(), w_t[:, k]) for k, lg in enumerate(w_logits))
        loss = answer_loss + args.aux_weight * aux_loss + args.word_weight * word_loss
        opt.zero_grad(set_to_none=True)
        word_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(aux.parameters()) + list(word_heads.parameters()), args.clip)
        for group in word_opt.param_groups:
            group["lr"] = lr
        word_opt.step()
        opt.step()
        step_time = time.time() - t0
        state["step"] += 1
        state["images"] += args.images_per_step
        state["train_seconds"] += step_time
        answer_acc = (logits[0::2].argmax(-1) == labels[0::2]).float().mean().item()
        window["loss"].append(answer_loss.item())
        window["aux_loss"].append(aux_loss.item())
        window["word_loss"].append(word_loss.item())
        window["acc"].append(answer_acc)
        window["step_time"].append(step_time)
        window["data_time"].append(t_data)
        window["tokens"].append(int((input_ids != enc.pad_id).sum()))
        if args.profile:
            log(f"step {state['step']}: {step_time:.3f}s (data {t_data:.3f}s) seq {input_ids.shape} "
                f"vision tokens {[enc.n_tokens(g) for g in grid]} loss {answer_loss.item():.3f} aux {aux_loss.item():.3f}")
            continue
        if state["step"] % 25 == 0:
            m = {k: float(np.mean(v)) for k, v in window.items()}
            state["curve"].append(
                dict(step=state["step"], images=state["images"], minutes=state["train_seconds"] / 60, lr=lr,
                     loss=m["loss"], aux_loss=m["aux_loss"], word_loss=m["word_loss"], train_acc=m["acc"])
            )
            log(f"step {state['step']} img {state['images']} lr {lr:.2e} loss {m['loss']:.3f} aux {m['aux_loss']:.3f} word {m['word_loss']:.3f} "
                f"train_acc {m['acc']:.3f} step {m['step_time']:.2f}s (data {m['data_time']:.2f}s, {m['tokens']:.0f} tok)",
                log_path)
            window.clear()
        now = time.time()
        if now - last_eval > args.eval_every * 60:
            t_eval = time.time()
            report = val.report(val.predict(model))
            state["curve"].append(
                dict(step=state["step"], images=state["images"], minutes=state["train_seconds"] / 60,
                     val_accuracy=report["accuracy"], val_by_qtype=report["by_qtype"])
            )
            if report["accuracy"] > state["best_acc"]:
                state["best_acc"] = report["accuracy"]
                state["best"] = copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()})
                state["best_info"] = dict(snapshot_info(), val_accuracy=report["accuracy"], val_by_qtype=report["by_qtype"])
            log(f"eval step {state['step']}: val {report['accuracy']:.3f} "
                f"{json.dumps({k: round(v, 3) for k, v in report['by_qtype'].items()})} "
                f"(best {state['best_acc']:.3f}, {time.time() - t_eval:.0f}s)", log_path)
            last_eval = time.time()
        if time.time() - last_export > args.export_every * 60:
            do_export()
            last_export = time.time()
        if time.time() - last_ckpt > args.checkpoint_every * 60:
            save_checkpoint(ckpt_path, dict(model=model.state_dict(), aux=aux.state_dict(), opt=opt.state_dict(), state=state,
                                 word_heads=word_heads.state_dict(), word_opt=word_opt.state_dict()))
            last_ckpt = time.time()
    if args.profile:
        times = window["step_time"][1:] or window["step_time"]
        log(f"mean step {np.mean(times):.3f}s, data {np.mean(window['data_time']):.3f}s, params {n_params:,}")
        return
    report = val.report(val.predict(model))
    state["curve"].append(dict(step=state["step"], images=state["images"], minutes=state["train_seconds"] / 60,
                               val_accuracy=report["accuracy"], val_by_qtype=report["by_qtype"]))
    if report["accuracy"] > state["best_acc"]:
        state["best_acc"] = report["accuracy"]
        state["best"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        state["best_info"] = dict(snapshot_info(), val_accuracy=report["accuracy"], val_by_qtype=report["by_qtype"])
    save_checkpoint(ckpt_path, dict(model=model.state_dict(), aux=aux.state_dict(), opt=opt.state_dict(), state=state,
                                 word_heads=word_heads.state_dict(), word_opt=word_opt.state_dict()))
    do_export()
    log(f"done: step {state['step']}, best val {state['best_acc']:.3f}", log_path)


if __name__ == "__main__":
    main()
