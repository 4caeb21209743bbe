"""Image QA with the bundled demo model: full mode as good as its model card says, and POP/static measured."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import pop_vlm
from pop_vlm import zoo
from pop_vlm.evaluate import shapes_qa_report
from pop_vlm.shapes import sample_from_record

MODEL = "shapes-qwen3-vl"
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "shapes_qa.json"


@pytest.fixture(scope="module")
def pipe():
    if MODEL not in zoo.available_bundled():
        pytest.fail(f"the bundled model {MODEL} is missing from {zoo.bundled_path(MODEL)}")
    return pop_vlm.load(MODEL, device="cpu")


@pytest.fixture(scope="module")
def records():
    path = zoo.assets_dir() / "qa" / "shapes_test.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def card_accuracy() -> float:
    card = (zoo.bundled_path(MODEL) / "model_card.md").read_text()
    return float(re.search(r"Overall: \*\*([0-9.]+)\*\*", card).group(1))


def test_test_set_is_large_and_covers_the_task(records):
    assert len(records) >= 300
    assert {r["qtype"] for r in records} == {"color_of_shape", "shape_of_color", "count", "exists", "left_right"}
    assert all(r["seed"] >= 10**9 for r in records)


def test_bundled_model_answers_the_shapes_test_set(pipe, records):
    report = shapes_qa_report(pipe, records)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    full = report["accuracy"]["full"]["all"]
    assert full >= card_accuracy() - 0.02
    assert full >= 0.80
    for mode in ("pop", "static"):  # measured and written, whatever they are
        assert 0.0 <= report["accuracy"][mode]["all"] <= 1.0
    assert report["vision_tokens"]["max"] > report["vision_tokens"]["min"] > 0


def test_answer_is_the_same_for_path_pil_and_numpy(records, tmp_path, monkeypatch):
    monkeypatch.delenv("POP_VLM_MODEL", raising=False)
    image, question, _ = sample_from_record(records[0])
    path = tmp_path / "shapes.png"
    image.save(path)
    answers = {pop_vlm.answer(source, question, max_new_tokens=4).text
               for source in (str(path), image, np.asarray(image))}
    assert len(answers) == 1
