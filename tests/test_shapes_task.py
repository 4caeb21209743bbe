"""Conformance tests for the synthetic shapes task (`pop_vlm.shapes`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pop_vlm import shapes as S

TEST_SET = Path(__file__).resolve().parents[1] / "assets" / "qa" / "shapes_test.jsonl"
SEEDS = range(40)


def obj(shape, color, bbox, size="large"):
    return S.ShapeObject(shape, color, size, bbox)


def scene(objects, width=448, height=320, background="white"):
    return S.Scene(width, height, background, tuple(objects), noise_seed=7)


@pytest.fixture(scope="module")
def scenes():
    return [S.sample_scene(seed) for seed in SEEDS]


def test_scene_spec(scenes):
    for sc in scenes:
        assert sc.width in S.CANVAS_SIZES and sc.height in S.CANVAS_SIZES
        assert sc.background in S.BACKGROUNDS
        assert 1 <= len(sc.objects) <= 4
        short = min(sc.width, sc.height)
        for o in sc.objects:
            x0, y0, x1, y1 = o.bbox
            assert o.shape in S.SHAPES and o.color in S.COLORS
            assert x1 - x0 == y1 - y0, "bounding boxes are square"
            assert 0 <= x0 < x1 <= sc.width and 0 <= y0 < y1 <= sc.height, "fully inside the canvas"
            low, high = S.SIZE_RANGES[o.size]
            assert low * short <= o.side <= high * short
        for i, a in enumerate(sc.objects):
            for b in sc.objects[i + 1 :]:
                assert not S.boxes_overlap(a.bbox, b.bbox)


def test_sampler_covers_the_spec():
    many = [S.sample_scene(seed) for seed in range(300)]
    assert {sc.width for sc in many} == set(S.CANVAS_SIZES) == {sc.height for sc in many}
    assert {sc.background for sc in many} == set(S.BACKGROUNDS)
    assert {len(sc.objects) for sc in many} == {1, 2, 3, 4}
    objects = [o for sc in many for o in sc.objects]
    assert {o.shape for o in objects} == set(S.SHAPES)
    assert {o.color for o in objects} == set(S.COLORS)
    assert {o.size for o in objects} == {"small", "large"}


def test_four_large_objects_fit_on_the_smallest_canvas():
    sc = S.sample_scene(3, n_objects=4, large_prob=1.0, canvas=(224, 224))
    assert len(sc.objects) == 4


def test_determinism():
    assert S.sample_scene(123) == S.sample_scene(123)
    assert S.sample_scene(123) != S.sample_scene(124)
    a, b = S.sample_scene(5), S.sample_scene(5)
    assert np.array_equal(S.render_array(a), S.render_array(b))
    assert S.questions(a, 9) == S.questions(b, 9)
    assert S.questions(a, 9, n=5) == S.questions(b, 9, n=5)
    assert S.make_records([10**9, 10**9 + 1]) == S.make_records([10**9, 10**9 + 1])


def test_render_colours_and_shapes():
    square = obj("square", "red", (10, 10, 50, 50))
    circle = obj("circle", "blue", (100, 100, 160, 160))
    triangle = obj("triangle", "green", (300, 20, 360, 80))
    pixels = S.render_array(scene([square, circle, triangle], background="grey"))
    assert pixels.shape == (320, 448, 3) and pixels.dtype == np.uint8
    assert (pixels[10:50, 10:50] == S.COLORS["red"]).all()  # filled square, exact bbox
    assert (pixels[9, 10:50] == (230, 230, 230)).all() and (pixels[10:50, 50] == (230, 230, 230)).all()
    assert (pixels[130, 130] == S.COLORS["blue"]).all()  # disc centre
    assert (pixels[101, 101] == (230, 230, 230)).all()  # bbox corner outside the disc
    assert (pixels[21, 329] == S.COLORS["green"]).all()  # near the apex, centred
    assert (pixels[21, 301] == (230, 230, 230)).all()  # top corner is empty
    assert (pixels[79, 301] == S.COLORS["green"]).all()  # base spans the bbox width
    colours = {tuple(c) for c in pixels.reshape(-1, 3)}
    assert colours == {(230, 230, 230), S.COLORS["red"], S.COLORS["blue"], S.COLORS["green"]}


def test_backgrounds():
    sq = obj("square", "purple", (0, 0, 30, 30))
    white = S.render_array(scene([sq], background="white"))
    assert (white[100:, 100:] == 255).all()
    noise = S.render_array(scene([sq], background="noise"))
    region = noise[100:, 100:]
    assert region.min() >= 200 and region.max() <= 255 and region.std() > 10
    assert np.array_equal(noise, S.render_array(scene([sq], background="noise")))
    image = S.render(scene([sq]))
    assert image.mode == "RGB" and image.size == (448, 320)


def test_answers_for_a_constructed_scene():
    sc = scene(
        [
            obj("circle", "red", (10, 10, 60, 60)),  # left
            obj("square", "red", (300, 200, 340, 240)),  # right
            obj("triangle", "blue", (200, 10, 260, 70)),  # straddles the middle (x = 224)
        ]
    )
    cands = S.candidate_questions(sc)
    assert dict(cands["color_of_shape"]) == {
        "What color is the circle?": "red",
        "What color is the square?": "red",
        "What color is the triangle?": "blue",
    }
    assert dict(cands["shape_of_color"]) == {"What shape is the blue object?": "triangle"}  # two red objects
    assert cands["count"] == [("How many shapes are there?", "3")]
    exists = dict(cands["exists"])
    assert len(exists) == 18
    assert exists["Is there a red circle?"] == "yes" and exists["Is there a blue square?"] == "no"
    assert exists["Is there a blue triangle?"] == "yes" and exists["Is there a red triangle?"] == "no"
    assert dict(cands["left_right"]) == {
        "Is the red circle on the left or the right?": "left",
        "Is the red square on the left or the right?": "right",
    }


def test_uniqueness_rules():
    two_circles = scene([obj("circle", "red", (0, 0, 40, 40)), obj("circle", "red", (300, 0, 340, 40))])
    cands = S.candidate_questions(two_circles)
    assert cands["color_of_shape"] == [] and cands["shape_of_color"] == [] and cands["left_right"] == []
    assert {q for q, _, t in S.questions(two_circles, 0)} >= {"How many shapes are there?"}
    edge = scene([obj("square", "green", (184, 0, 224, 40)), obj("square", "blue", (224, 100, 264, 140))])
    assert dict(S.candidate_questions(edge)["left_right"]) == {
        "Is the green square on the left or the right?": "left",
        "Is the blue square on the left or the right?": "right",
    }


def test_questions_are_valid(scenes):
    for i, sc in enumerate(scenes):
        valid = {q: (a, t) for t, qas in S.candidate_questions(sc).items() for q, a in qas}
        for question, answer, qtype in S.questions(sc, i) + S.questions(sc, i, n=6):
            assert valid[question] == (answer, qtype)
            assert answer in S.ANSWERS and answer == answer.lower() and " " not in answer


def test_question_type_weights():
    sc = scene([obj("circle", "red", (0, 0, 40, 40)), obj("square", "blue", (300, 0, 340, 40))])
    only = S.questions(sc, 1, n=3, qtype_weights={"left_right": 1.0})
    assert {t for _, _, t in only} == {"left_right"} and len(only) == 2  # only two such questions exist
    drawn = S.questions(sc, 2, n=10, qtype_weights={"exists": 1.0})
    assert len(drawn) == len({q for q, _, _ in drawn}) == 10
    assert {a for _, a, _ in drawn} == {"yes", "no"}


@pytest.mark.parametrize(
    "pred, answer, expected",
    [("Red", "red", 1.0), (" red. ", "red", 1.0), ("YES!", "yes", 1.0), ("3", "3", 1.0), ("left,", "left", 1.0),
     ("reds", "red", 0.0), ("no", "yes", 0.0), ("", "red", 0.0), ("the red", "red", 0.0)],
)
def test_score(pred, answer, expected):
    assert S.score(pred, answer) == expected


def test_record_round_trip():
    sc = S.sample_scene(77)
    question, answer, qtype = S.questions(sc, 77, n=1)[0]
    record = json.loads(json.dumps(S.scene_to_record(sc, question, answer, qtype)))
    assert S.scene_from_record(record) == sc
    image, q, a = S.sample_from_record(record)
    assert (q, a) == (question, answer)
    assert np.array_equal(np.asarray(image), S.render_array(sc))


def test_label_grid():
    sc = scene([obj("square", "red", (0, 0, 224, 160))], width=448, height=320)
    grid = S.label_grid(sc, 4, 4)
    assert grid[:2, :2].tolist() == [[1, 1], [1, 1]] and (grid[2:, :] == 0).all() and (grid[:, 2:] == 0).all()


def test_bundled_test_set():
    records = [json.loads(line) for line in TEST_SET.read_text().splitlines() if line.strip()]
    assert len(records) >= 300
    assert {r["qtype"] for r in records} == set(S.QTYPES)
    assert {r["width"] for r in records} == set(S.CANVAS_SIZES) == {r["height"] for r in records}
    assert all(r["seed"] >= 10**9 for r in records)
    for r in records[:40]:
        sc = S.scene_from_record(r)
        valid = {q: (a, t) for t, qas in S.candidate_questions(sc).items() for q, a in qas}
        assert valid[r["question"]] == (r["answer"], r["qtype"])
    assert S.make_records([records[0]["seed"]], S.QTYPES)[0] == records[0]  # reproducible from the seed
