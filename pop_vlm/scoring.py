"""Whether a generated answer counts as the expected one: the one scorer of image QA and the shapes task.

Both texts are normalised first (lower-cased, every run of characters other than letters and digits turned into one
space), so case, punctuation and spacing never decide a match.
"""
from __future__ import annotations

QA_MATCHES = ("contains", "exact")


def normalise(text: str) -> str:
    return " ".join("".join(c.lower() if c.isalnum() else " " for c in str(text)).split())


def check_match(match: str) -> str:
    if match not in QA_MATCHES:
        raise ValueError(f"unknown answer match {match!r}: use one of {', '.join(QA_MATCHES)}")
    return match


def answer_matches(text: str, expected: str, match: str = "contains") -> bool:
    """`contains`: the normalised expected answer occurs in the normalised answer (free-form answers);
    `exact`: the normalised texts are equal (one-word answers, as the shapes task scores them)."""
    if check_match(match) == "exact":
        return normalise(text) == normalise(expected)
    return normalise(expected) in normalise(text)
