"""The one answer scorer (`pop_vlm.scoring`) and the modules that score through it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pop_vlm import evaluate, scoring, shapes


@pytest.mark.parametrize("text, expected, contains, exact", [
    ("red", "red", True, True),
    ("  Red.\n", "red", True, True),
    ("YES!", "yes", True, True),
    ("It is red.", "red", True, False),
    ("reddish", "red", True, False),  # containment is of text, not of whole words
    ("blue", "red", False, False),
    ("", "red", False, False),
    ("left, right", "Left right", True, True),
    ("tri-angle", "triangle", False, False),  # punctuation splits words, it does not join them
])
def test_contains_and_exact(text, expected, contains, exact):
    assert scoring.answer_matches(text, expected) is contains
    assert scoring.answer_matches(text, expected, "contains") is contains
    assert scoring.answer_matches(text, expected, "exact") is exact


def test_normalise_lowercases_and_turns_punctuation_into_single_spaces():
    assert scoring.normalise("  What's the COLOUR?! ") == "what s the colour"
    assert scoring.normalise("a_b--c") == "a b c"
    assert scoring.normalise(3) == "3"


def test_an_unknown_match_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown answer match 'fuzzy': use one of contains, exact"):
        scoring.answer_matches("red", "red", "fuzzy")
    assert scoring.check_match("exact") == "exact"
    assert scoring.QA_MATCHES == ("contains", "exact")


def test_evaluate_and_shapes_score_through_it():
    for name in ("QA_MATCHES", "normalise", "check_match", "answer_matches"):
        assert getattr(evaluate, name) is getattr(scoring, name)
    assert not hasattr(shapes, "normalize_answer")
    for pred, answer in [("Red.", "red"), ("the red", "red"), ("tri-angle", "triangle"), ("3", "3")]:
        assert shapes.score(pred, answer) == float(scoring.answer_matches(pred, answer, "exact"))


def test_scoring_imports_nothing_but_the_future():
    """Pure Python: scoring a file of answers needs neither torch nor the rest of the package."""
    tree = ast.parse(Path(scoring.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [getattr(node, "module", None) for node in imports] == ["__future__"]
