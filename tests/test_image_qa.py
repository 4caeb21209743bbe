"""Image QA's one loop (`evaluate.image_qa`): groups, vision tokens, alternating order, and the shapes report
built on it."""
from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from pop_vlm import evaluate as ev
from pop_vlm import shapes


class ScriptedVLM:
    """A stand-in pipeline: `answer(index, mode)` says what it answers; every run is recorded."""

    is_multimodal = True
    name = "scripted"
    num_layers = 6

    def __init__(self, answer):
        self.answer = answer
        self.calls = []
        self.n_built = 0

    def build_inputs(self, image, question):
        self.n_built += 1
        return {"index": self.n_built - 1}

    def generate(self, inputs, mode, pop, max_new_tokens):
        index = inputs["index"]
        self.calls.append((index, mode, None if pop is None else pop.prune_layers))
        ttft = {"full": 3.0, "pop": 2.0, "static": 1.0}[mode] + index / 10
        return SimpleNamespace(text=self.answer(index, mode), timings=SimpleNamespace(ttft_s=ttft),
                               n_image_tokens=40 + 10 * index)


def test_image_qa_groups_vision_tokens_and_alternating_order():
    samples = [{"image": None, "question": "q", "answer": "red", "colour": "warm"},
               {"image": None, "question": "q", "answer": "blue", "colour": "cold"},
               {"image": None, "question": "q", "answer": "yellow", "colour": "warm"}]
    right = {"full": {0, 1, 2}, "pop@2": {0, 1}, "static@2": {1}}
    pipe = ScriptedVLM(lambda i, mode: samples[i]["answer"].upper() + "."
                       if i in right[{"full": "full", "pop": "pop@2", "static": "static@2"}[mode]] else "green")
    variants = ev.variants_for([2], ("full", "pop", "static"))
    qa = ev.image_qa(pipe, samples, variants, match="exact", group_by=lambda s: ["all", f"colour:{s['colour']}"])
    assert qa["accuracy_by_group"] == {
        "full": {"all": 1.0, "colour:cold": 1.0, "colour:warm": 1.0},
        "pop@2": {"all": 2 / 3, "colour:cold": 1.0, "colour:warm": 0.5},
        "static@2": {"all": 1 / 3, "colour:cold": 1.0, "colour:warm": 0.0},
    }
    assert qa["accuracy"] == {label: groups["all"] for label, groups in qa["accuracy_by_group"].items()}
    assert qa["vision_tokens"] == {"mean": 50.0, "min": 40, "max": 60}
    assert pipe.n_built == 3  # once per sample, shared by the variants
    assert [(i, mode) for i, mode, _ in pipe.calls] == [
        (0, "full"), (0, "pop"), (0, "static"), (1, "static"), (1, "pop"), (1, "full"),
        (2, "full"), (2, "pop"), (2, "static")]
    assert qa["ttft_median_s"] == {"full": 3.1, "pop@2": 2.1, "static@2": 1.1}

    plain = ev.image_qa(ScriptedVLM(lambda i, mode: "red"), samples, variants)
    assert "accuracy_by_group" not in plain and "vision_tokens" not in plain
    assert plain["accuracy"]["full"] == 1 / 3 and plain["match"] == "contains"


@pytest.mark.parametrize("prune_layers, k", [(None, 2), (1, 1)])
def test_shapes_qa_report_is_keyed_by_mode(prune_layers, k):
    records = shapes.make_records(range(4), shapes.QTYPES)

    def answer(index, mode):
        ok = mode == "full" or (mode == "pop" and index < 2)
        return f" {records[index]['answer'].title()}!" if ok else "zzz"

    pipe = ScriptedVLM(answer)
    report = ev.shapes_qa_report(pipe, records, prune_layers=prune_layers)
    assert list(report) == ["model", "n", "k", "num_layers", "vision_tokens", "accuracy", "ttft_median_s"]
    assert (report["model"], report["n"], report["k"], report["num_layers"]) == ("scripted", 4, k, 6)
    assert report["vision_tokens"] == {"mean": 55.0, "min": 40, "max": 70}
    groups = sorted({g for r in records for g in ev.shapes_groups(r)})
    assert list(report["accuracy"]) == ["full", "pop", "static"]
    assert all(list(report["accuracy"][mode]) == groups for mode in report["accuracy"])
    assert report["accuracy"]["full"]["all"] == 1.0 and report["accuracy"]["static"]["all"] == 0.0
    assert report["accuracy"]["pop"]["all"] == 0.5
    assert report["accuracy"]["pop"][f"type:{records[0]['qtype']}"] == 1.0
    assert report["accuracy"]["pop"][f"type:{records[3]['qtype']}"] == 0.0
    assert report["ttft_median_s"] == {mode: statistics.median(base + i / 10 for i in range(4))
                                       for mode, base in (("full", 3.0), ("pop", 2.0), ("static", 1.0))}
    assert {prune for _, mode, prune in pipe.calls if mode != "full"} == {k}
    assert [mode for i, mode, _ in pipe.calls if i == 1] == ["static", "pop", "full"]


def test_shapes_qa_report_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode 'pop-no-kv'"):
        ev.shapes_qa_report(ScriptedVLM(lambda i, mode: ""), shapes.make_records(range(1)), modes=("full", "pop-no-kv"))


def test_image_qa_groups_on_a_tiny_vlm(pipelines):
    pipe = pipelines("tiny-gemma3-vlm")
    records = shapes.make_records(range(800_000_000, 800_000_003))
    expected = pipe.answer(*shapes.sample_from_record(records[0])[:2], mode="full", max_new_tokens=3).text
    records[0] = dict(records[0], answer=expected or "-")  # the tiny model's own answer: a hit under full
    records[1:] = [dict(r, answer="not-an-answer-zq") for r in records[1:]]
    variants = ev.variants_for([2], ("full", "pop"))
    qa = ev.image_qa(pipe, records, variants, max_new_tokens=3, match="exact",
                     group_by=lambda r: ["all", "first" if r["seed"] == 800_000_000 else "rest"])
    assert qa["accuracy_by_group"]["full"] == {"all": 1 / 3, "first": 1.0, "rest": 0.0}
    assert set(qa["accuracy_by_group"]) == {"full", "pop@2"}
    assert 0 < qa["vision_tokens"]["min"] <= qa["vision_tokens"]["mean"] <= qa["vision_tokens"]["max"]
