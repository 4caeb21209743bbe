"""Serving limits: configurable by flags and environment variables, checked before any model work."""
from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass, fields

import pop_vlm.images

ENV_PREFIX = "POP_VLM_"


@dataclass
class Limits:
    """Each field can be set by the environment variable POP_VLM_<FIELD NAME IN CAPITALS> or a serve flag."""

    max_upload_bytes: int = 20 * 1024 * 1024  # one image, after base64 decoding
    max_image_pixels: int = 64_000_000  # refused above; images within it are downscaled to the processor's budget
    max_question_chars: int = 8000
    max_new_tokens: int = 1024
    queue_size: int = 16  # requests waiting for the model beyond this are refused (HTTP 429)
    max_batch_size: int = 16  # requests decoded together in one batched step (1: one request at a time)
    max_tokens_in_flight: int = 0  # prompt + answer tokens the batch may hold at once (0: no limit)
    request_timeout_s: float = 300.0  # waiting for the model plus generating

    @classmethod
    def from_env(cls, **overrides) -> "Limits":
        values = {}
        for field in fields(cls):
            raw = os.environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                try:
                    values[field.name] = type(field.default)(float(raw)) if field.type != "str" else raw
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX + field.name.upper()} must be a number, got {raw!r}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        limits = cls(**values)
        limits.apply()
        return limits

    def apply(self) -> None:
        """Limits that live in the library (the image decoder's pixel cap)."""
        pop_vlm.images.MAX_IMAGE_PIXELS = int(self.max_image_pixels)

    def clean_question(self, text) -> str:
        """The question with control characters removed, or a ValueError saying what is wrong."""
        if not isinstance(text, str):
            raise ValueError("the question must be text")
        if len(text) > self.max_question_chars:
            raise ValueError(f"the question has {len(text)} characters; the limit is {self.max_question_chars}")
        cleaned = "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch) != "Cc")
        if not cleaned.strip():
            raise ValueError("the question is empty")
        return cleaned

    def check_new_tokens(self, value) -> int:
        if isinstance(value, bool):
            raise ValueError("max_new_tokens must be an integer")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"max_new_tokens must be an integer, got {value!r}") from None
        if not number.is_integer() or not 1 <= number <= self.max_new_tokens:
            raise ValueError(f"max_new_tokens must be an integer between 1 and {self.max_new_tokens}, got {value!r}")
        return int(number)
