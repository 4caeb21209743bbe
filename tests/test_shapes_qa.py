"""Image QA with the bundled demo models: full prefill as good as the model card says, POP within 2 points of it.

Each card's "Full, POP and static prefill" section (written by `scripts/shapes_qa.py --card`) names the layers
POP prunes, the accuracy of each mode on the whole test set `assets/qa/shapes_test.jsonl`, and on a check set, its
first records: all 600 for the small Qwen3-VL demo, fewer for the Gemma-3 one, whose 270M language model takes
about a second per answer on CPU. The test measures the check set again: each mode must reproduce the card's
figure there (so a POP that lost accuracy fails), and POP must stay within two points of full on the whole set,
measured here when the check set is the whole set, else as the card measured it (on 100 records the two modes
differ on a few answers either way, as much as 4 points, while on 600 they agree within 0.2).
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import pop_vlm
from pop_vlm import zoo
from pop_vlm.evaluate import shapes_qa_report
from pop_vlm.shapes import sample_from_record
from pop_vlm.train.card import check_figures

#: the least each bundled model must score on its check set, whatever its card says
FLOORS = {"shapes-qwen3-vl": 0.80, "shapes-gemma-3": 0.65}
#: two points, and a hair for float arithmetic (0.70 - 0.68 is 0.0200000000000000018)
TWO_POINTS = 0.02 + 1e-9


@pytest.fixture(scope="module")
def records():
    path = zoo.assets_dir() / "qa" / "shapes_test.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", params=sorted(FLOORS))
def bundled(request):
    name = request.param
    if name not in zoo.available_bundled():
        pytest.fail(f"the bundled model {name} is not loadable here (folder {zoo.bundled_path(name)}; "
                    "shapes-gemma-3 also needs the gemma extra, part of the test extra)")
    card = (zoo.bundled_path(name) / "model_card.md").read_text()
    check = check_figures(card)
    if check is None:
        pytest.fail(f"the model card of {name} has no check set: run scripts/shapes_qa.py --model {name} --card")
    overall = float(re.search(r"Overall: \*\*([0-9.]+)\*\*", card).group(1))
    return name, pop_vlm.load(name, device="cpu"), check, overall


def test_test_set_is_large_and_covers_the_task(records):
    assert len(records) >= 300
    assert {r["qtype"] for r in records} == {"color_of_shape", "shape_of_color", "count", "exists", "left_right"}
    assert all(r["seed"] >= 10**9 for r in records)


def test_full_matches_the_card_and_pop_stays_within_two_points(bundled, records):
    name, pipe, check, overall = bundled
    assert 0 < check["n"] <= len(records)
    report = shapes_qa_report(pipe, records[: check["n"]], modes=("full", "pop"), prune_layers=check["k"])
    full, pop = report["accuracy"]["full"]["all"], report["accuracy"]["pop"]["all"]
    assert report["k"] == check["k"]
    assert full >= FLOORS[name], f"{name}: full {full:.3f} below the floor {FLOORS[name]}"
    for mode, measured in (("full", full), ("pop", pop)):
        card_figure = check["accuracy"][mode]
        assert measured >= card_figure - TWO_POINTS, f"{name}: {mode} {measured:.3f} on the check set, card {card_figure}"
    whole = check["whole"]
    assert abs(whole["full"] - overall) <= TWO_POINTS  # the card's two measurements of full on the whole set agree
    assert abs(whole["pop"] - whole["full"]) <= TWO_POINTS, f"{name}: the card's POP {whole['pop']} vs full {whole['full']}"
    if check["n"] == len(records):
        assert full >= overall - TWO_POINTS
        assert abs(pop - full) <= TWO_POINTS, f"{name}: POP {pop:.3f} vs full {full:.3f} at k = {check['k']}"
    assert report["vision_tokens"]["min"] > 0


def test_answer_is_the_same_for_path_pil_and_numpy(records, tmp_path, monkeypatch):
    monkeypatch.delenv("POP_VLM_MODEL", raising=False)
    image, question, _ = sample_from_record(records[0])
    path = tmp_path / "shapes.png"
    image.save(path)
    answers = {pop_vlm.answer(source, question, max_new_tokens=4).text
               for source in (str(path), image, np.asarray(image))}
    assert len(answers) == 1
