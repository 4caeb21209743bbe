"""The text of generated tokens as it streams: stop strings, and what may be shown so far.

A stop string can arrive split over several tokens, so the text that may be shown holds back any suffix that
could still become a stop string, and an incomplete multi-byte character, until the next tokens decide.
"""
from __future__ import annotations

from typing import Callable, Sequence


def check_stop(stop) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings (None, a string, or a sequence of strings)."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    return strings


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest stop string in `text` begins, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is the beginning (not the whole) of a stop string."""
    longest = min(len(text), max((len(s) for s in stop), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stop):
            return k
    return 0


class DecodedText:
    """The decoded text of one choice's tokens, cut before the first stop string once one appears."""

    def __init__(self, decode: Callable[[list[int]], str], stop=None):
        self.decode = decode
        self.stop = check_stop(stop)
        self.text = ""
        self.stopped = False
        self._ends: list[int] = []  # _ends[i]: length of the text of the first i + 1 tokens

    def add(self, token_ids: list[int]) -> bool:
        """Decode the tokens so far (the newest one last); True once a stop string has appeared."""
        text = self.decode(token_ids)
        self._ends.append(len(text))
        cut = first_stop(text, self.stop)
        self.text, self.stopped = (text, False) if cut is None else (text[:cut], True)
        return self.stopped

    def visible(self, final: bool = False) -> str:
        """The text that may be shown now; `final` once no more tokens will come."""
        if self.stopped or final:
            return self.text
        text = self.text.rstrip("\ufffd")  # an incomplete multi-byte character: the next token completes it
        return text[: len(text) - held_back(text, self.stop)]

    def tokens_covering(self, n_chars: int) -> int:
        """How many leading tokens have text starting before character `n_chars` (the tokens of a text that
        long; the last of them may reach into a stop string)."""
        count = 0
        for start in [0, *self._ends[:-1]]:
            if start >= n_chars:
                break
            count += 1
        return count


class Piece(str):
    """A streamed piece of text: `index` is the choice it belongs to, `logprobs` those of the tokens whose text
    begins in it (when asked for)."""

    index: int = 0
    logprobs: list | None = None

    def __new__(cls, text: str, index: int = 0, logprobs: list | None = None):
        piece = super().__new__(cls, text)
        piece.index, piece.logprobs = index, logprobs
        return piece
