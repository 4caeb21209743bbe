"""Conversations about an image: the KV of everything already said is kept and reused for the next question.

A follow-up runs only its new tokens. `PrefixCache` keeps conversation caches keyed by what produced them (the
images' content, the model, the mode and the POP settings), least recently used first out, within a byte
budget. An entry is taken out while a turn extends it and put back after, so no two requests share one.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_BUDGET_BYTES = int(os.environ.get("POP_VLM_PREFIX_CACHE_BYTES", 512 * 1024**2))


def image_fingerprint(inputs: dict, keys: tuple[str, ...] = ("pixel_values",)) -> str:
    """A content hash of the prompt's images — the processor's tensors named by `keys` (the family adapter's
    `image_input_keys`: preprocessed pixels, and for some families their grid) — '' for a text-only prompt."""
    if not isinstance(inputs.get(keys[0]), torch.Tensor):
        return ""
    digest = hashlib.sha256()
    for name in keys:
        value = inputs.get(name)
        if isinstance(value, torch.Tensor):
            digest.update(name.encode())
            digest.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cache_nbytes(cache) -> int:
    """Bytes the cache's K/V tensors keep alive: whole storages (preallocated room included), each counted once."""
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CachedPrefix:
    token_ids: list[int]  # the tokens whose K/V the cache holds, in order
    cache: object
    nbytes: int


class PrefixCache:
    """Conversation caches, LRU within `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_BUDGET_BYTES):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, CachedPrefix] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key: tuple, token_ids: list[int]) -> tuple[object, int] | None:
        """Remove and return (cache, reusable length) for `key` when its tokens start `token_ids`'s prefix.

        The cache is cropped to the common prefix, which always leaves at least one new token to run.
        """
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            return None
        shared = min(common_prefix(entry.token_ids, token_ids), len(token_ids) - 1)
        if shared <= 0:
            return None
        drop = len(entry.token_ids) - shared
        if drop:
            try:
                entry.cache.crop(-drop)
            except (RuntimeError, ValueError):  # a sliding-window layer cannot go back that far
                return None
        return entry.cache, shared

    def put(self, key: tuple, token_ids: list[int], cache) -> None:
        nbytes = cache_nbytes(cache)
        if nbytes > self.max_bytes:
            return
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = CachedPrefix(list(token_ids), cache, nbytes)
            while self._entries and self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class Conversation:
    """A multi-turn chat with one pipeline: `ask` adds a user turn (optionally with an image) and answers it,
    reusing the cache of the turns before."""

    def __init__(self, pipeline, image=None, mode: str = "pop", pop=None, **generation):
        self.pipeline = pipeline
        self.mode, self.pop, self.generation = mode, pop, generation
        self.messages: list[dict] = []
        self._pending_image = image

    def ask(self, question: str, image=None, **overrides):
        *_, answer = self.stream(question, image=image, **overrides)
        return answer

    def stream(self, question: str, image=None, **overrides):
        """Yield text pieces of the answer; the last item is the `Answer` (then the turn is in `messages`)."""
        image = image if image is not None else self._pending_image
        self._pending_image = None
        content = ([{"type": "image", "image": image}] if image is not None else []) + [{"type": "text", "text": question}]
        messages = self.messages + [{"role": "user", "content": content}]
        pieces = self.pipeline.stream_chat(messages, mode=self.mode, pop=self.pop, reuse_prefix=True,
                                           **{**self.generation, **overrides})
        return self._record(messages, pieces)

    def _record(self, messages, pieces):
        answer = None
        for answer in pieces:
            yield answer
        self.messages = messages + [{"role": "assistant", "content": [{"type": "text", "text": answer.text}]}]
