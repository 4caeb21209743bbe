"""The text of generated tokens as it streams: stop strings, and what may be shown so far.

A stop string can arrive split over several tokens, so the text that may be shown holds back any suffix that
could still become a stop string, and an incomplete multi-byte character, until the next tokens decide. Each new
token decodes a short window of recent tokens rather than the whole answer, which would make an answer's
decoding quadratic in its length.
"""
from __future__ import annotations

import bisect
import functools
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


#: Tokens of settled text that a window decodes before the new ones, at least: the left context of the decoders
#: that look back (a leading space stripped from the text's first token, spaces cleaned up around punctuation).
#: A window grows to twice this before it moves on, so that most steps decode only one window.
CONTEXT_TOKENS = 4


def local_decode(decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """`decode` (token ids -> text), marked as a tokenizer's decode: the text that tokens add depends on them and
    on a few tokens before them only, so that `DecodedText` may decode short windows of recent tokens. A callable
    left unmarked is decoded whole after every token (correct for any function, but quadratic over an answer)."""

    @functools.wraps(decode)
    def marked(*args, **kwargs):
        return decode(*args, **kwargs)

    marked.local_decode = True
    return marked


class DecodedText:
    """The decoded text of one choice's tokens, cut before the first stop string once one appears.

    With a decode marked `local_decode`, each token decodes a window of a few recent tokens, as vLLM's incremental
    detokenisation does: the window starts where the text was settled at least `CONTEXT_TOKENS` tokens back, and
    what it decodes beyond the text of its settled tokens is appended once it does not end in an incomplete
    character (U+FFFD). The text stays exactly `decode(token_ids)`: where a window's text does not begin with the
    text of its settled tokens, the decode looks back further than the window and the whole text is decoded instead.
    What was shown is never taken back, unless the decode takes back complete characters itself: an invalid byte
    joining a byte-fallback run turns the whole run into U+FFFD.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop=None):
        self.decode = decode
        self.stop = check_stop(stop)
        self._local = bool(getattr(decode, "local_decode", False))
        self._restart()

    def _restart(self) -> None:
        self.stopped = False
        self._ids: list[int] = []
        self._ends: list[int] = []  # _ends[i]: length of the settled text of the first i + 1 tokens
        self._settled = ""  # decode(ids[:marks[-1]]): text that later tokens only extend
        self._marks = [0]  # token offsets where the text was settled, the window's start first, the latest last
        self._prefix: str | None = ""  # decode(ids[marks[0]:marks[-1]]); None until decoded
        self._whole: str | None = ""  # decode(ids); None until decoded
        self._cut: int | None = None
        self._searched = 0  # how much of the settled text has been searched for stop strings

    @property
    def text(self) -> str:
        """`decode(token_ids)`, cut before the first stop string."""
        if self._whole is None:
            self._whole = self.decode(self._ids)
        return self._whole if self._cut is None else self._whole[: self._cut]

    def add(self, token_ids: list[int]) -> bool:
        """The tokens so far (the newest last; one list, growing by a token each call); True once a stop string has
        appeared."""
        known, start = len(self._ids), self._marks[0]
        if len(token_ids) < known or list(token_ids[start:known]) != self._ids[start:]:
            self._restart()  # not the tokens seen so far, extended: decode them afresh
            known = 0
        for n in range(known + 1, len(token_ids) + 1):
            self._ids.append(token_ids[n - 1])
            if self._local:
                self._step(n)
            else:
                self._step_whole(n)
            self._end(len(self._settled))
        self._find_stop()
        return self.stopped

    def _step(self, n: int) -> None:
        """Decode the window that ends with token n - 1."""
        ids, marks = self._ids, self._marks
        if self._prefix is None:
            self._prefix = self.decode(ids[marks[0]:marks[-1]])
        window = self.decode(ids[marks[0]:n])
        if window.startswith(self._prefix):
            tail = window[len(self._prefix):]
            if tail and not tail.endswith("\ufffd"):
                self._settle(self._settled + tail, n, window)
            else:  # no text yet (special tokens skipped), or an incomplete character that the next tokens decide
                self._whole = self._settled + tail
        elif window.endswith("\ufffd"):
            # The window's tokens changed the text of its first ones while a character is incomplete: a byte-fallback
            # run that is not valid UTF-8 (yet) decodes as U+FFFD as a whole, however far back it began. The whole
            # text waits until it is read, or until the character completes.
            self._whole = None
        else:
            # The window's text does not begin with that of its first tokens alone: this decode looks back further
            # than the window, and only a decode of every token is sure to be right.
            whole = self.decode(ids[:n])
            self._searched = 0  # text already searched may have changed
            if whole.endswith("\ufffd"):
                self._whole = whole
            else:
                self._settle(whole, n, None)

    def _settle(self, text: str, n: int, window: str | None) -> None:
        self._settled = self._whole = text
        marks = self._marks
        marks.append(n)
        if n - marks[0] > 2 * CONTEXT_TOKENS:
            while marks[1] <= n - CONTEXT_TOKENS:
                del marks[0]
            self._prefix = None
        else:
            self._prefix = window  # the next window starts where this one did: this one is its prefix

    def _step_whole(self, n: int) -> None:
        self._whole = self.decode(self._ids[:n])
        self._settled = self._whole.rstrip("\ufffd")  # an incomplete multi-byte character: the next token completes it
        self._searched = 0

    def _end(self, length: int) -> None:
        # text rewritten shorter (by a decode that looks back) moves the ends of earlier tokens with it: the ends
        # stay sorted for tokens_covering
        ends = self._ends
        i = len(ends)
        while i and ends[i - 1] > length:
            i -= 1
            ends[i] = length
        ends.append(length)

    def _find_stop(self) -> None:
        if not self.stop or self.stopped:
            return
        if self._whole is None:
            # the window turned text into U+FFFD (a byte-fallback run): no new character, so only a stop string
            # with U+FFFD in it can have appeared, in a text that may have changed anywhere
            if not any("\ufffd" in s for s in self.stop):
                return
            cut = first_stop(self.text, self.stop)
        else:
            # the whole text extends the settled text searched so far: only the end of that, where a stop string may
            # begin, and the new text are searched
            start = max(0, self._searched - max(len(s) for s in self.stop) + 1)
            cut = first_stop(self._whole[start:], self.stop)
            cut = None if cut is None else start + cut
            self._searched = len(self._settled)
        if cut is not None:
            self._cut, self.stopped = cut, True

    def visible(self, final: bool = False) -> str:
        """The text that may be shown now; `final` once no more tokens will come."""
        if self.stopped or final:
            return self.text
        text = self._settled
        return text[: len(text) - held_back(text, self.stop)]

    def tokens_covering(self, n_chars: int) -> int:
        """How many leading tokens have text starting before character `n_chars` (the tokens of a text that
        long; the last of them may reach into a stop string). A token whose text is only part of a character
        starts where that character does."""
        if n_chars <= 0 or not self._ends:
            return 0
        return 1 + bisect.bisect_left(self._ends, n_chars, 0, len(self._ends) - 1)


class Piece(str):
    """A streamed piece of text: `index` is the choice it belongs to, `logprobs` those of the tokens whose text
    begins in it (when asked for)."""

    index: int = 0
    logprobs: list | None = None

    def __new__(cls, text: str, index: int = 0, logprobs: list | None = None):
        piece = super().__new__(cls, text)
        piece.index, piece.logprobs = index, logprobs
        return piece
