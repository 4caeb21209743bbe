"""The public API: configs, sampling, streaming, image inputs, the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest

import pop_vlm
from pop_vlm import PopConfig
from pop_vlm.cli import main as cli_main
from pop_vlm.images import ImageError, load_image

from .conftest import QUESTION


def test_prune_layers_forms():
    assert PopConfig(prune_layers=9).num_pruned(28) == 9
    assert PopConfig().num_pruned(28) == 9  # default L/3
    assert PopConfig(prune_layers=0.5).pruned_layers(18) == tuple(range(9, 18))
    assert PopConfig(prune_layers="auto").num_pruned(18, auto_k=5) == 5
    for bad in (-1, 28, 1.5, "most", True):
        with pytest.raises(ValueError):
            PopConfig(prune_layers=bad).num_pruned(28)
    with pytest.raises(ValueError, match="importance"):
        PopConfig(prune_layers="auto").num_pruned(28)


def test_unknown_mode_is_refused(pipelines, picture):
    with pytest.raises(ValueError, match="unknown mode"):
        pipelines("tiny-qwen3-vl").answer(picture, QUESTION, mode="fast")


def test_streaming_yields_the_text_of_answer(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    pieces = list(pipe.stream(picture, QUESTION, mode="pop", max_new_tokens=10))
    final = pieces[-1]
    assert isinstance(final, pop_vlm.Answer)
    assert "".join(pieces[:-1]) == final.text
    assert final.text == pipe.answer(picture, QUESTION, mode="pop", max_new_tokens=10).text
    assert len(pieces) > 2


def test_answer_fields_and_timings(pipelines, picture):
    pipe = pipelines("tiny-qwen3-vl")
    answer = pipe.answer(picture, QUESTION, mode="pop", pop=PopConfig(prune_layers=2), max_new_tokens=4)
    assert answer.mode == "pop" and answer.pruned_layers == [4, 5]
    assert answer.n_image_tokens > 0 and answer.n_prompt_tokens > answer.n_image_tokens
    t = answer.timings
    assert t.vision_s > 0 and t.prefill_s > 0 and t.first_token_s > 0
    assert t.ttft_s == pytest.approx(t.preprocess_s + t.vision_s + t.prefill_s + t.first_token_s)
    assert t.peak_memory_bytes > 0
    assert len(answer.token_ids) == 4 and answer.finish_reason == "length"
    json.dumps(answer.as_dict())


def test_sampling_is_seeded_and_top_k_one_is_greedy(pipelines, picture):
    pipe = pipelines("tiny-llama")
    kwargs = dict(mode="pop", max_new_tokens=6, do_sample=True, temperature=1.5, top_p=0.9)
    a = pipe.answer(None, QUESTION, seed=7, **kwargs)
    b = pipe.answer(None, QUESTION, seed=7, **kwargs)
    c = pipe.answer(None, QUESTION, seed=8, **kwargs)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    greedy = pipe.answer(None, QUESTION, mode="pop", max_new_tokens=6)
    top1 = pipe.answer(None, QUESTION, mode="pop", max_new_tokens=6, do_sample=True, top_k=1, seed=1)
    assert top1.token_ids == greedy.token_ids
    with pytest.raises(ValueError, match="top_p"):
        pipe.answer(None, QUESTION, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        pipe.answer(None, QUESTION, max_new_tokens=0)


def test_same_answer_from_path_pil_and_numpy(pipelines, picture, tmp_path):
    pipe = pipelines("tiny-qwen3-vl")
    path = tmp_path / "picture.png"
    picture.save(path)
    answers = {kind: pipe.answer(image, QUESTION, max_new_tokens=6).token_ids
               for kind, image in (("path", str(path)), ("pil", picture), ("numpy", np.asarray(picture)))}
    assert answers["path"] == answers["pil"] == answers["numpy"]


def test_bad_inputs_get_clear_errors(pipelines, picture, tmp_path):
    pipe = pipelines("tiny-qwen3-vl")
    with pytest.raises(ValueError, match="question is empty"):
        pipe.answer(picture, "   ")
    with pytest.raises(ImageError, match="not found"):
        load_image(tmp_path / "missing.png")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    with pytest.raises(ImageError, match="cannot read"):
        pipe.answer(str(broken), QUESTION)
    with pytest.raises(ImageError, match="empty"):
        load_image(b"")
    with pytest.raises(ValueError, match="text-only"):
        pipelines("tiny-llama").answer(picture, QUESTION)


def test_more_image_inputs_are_read_or_refused_clearly(pipelines, picture, tmp_path):
    import io

    pixels = np.asarray(picture)
    png = tmp_path / "p.png"
    picture.save(png)
    with open(png, "rb") as handle:  # open binary files and BytesIO read like their bytes
        assert np.array_equal(np.asarray(load_image(handle)), np.asarray(load_image(png)))
    assert np.array_equal(np.asarray(load_image(io.BytesIO(png.read_bytes()))), np.asarray(load_image(png)))
    with open(png, encoding="latin-1") as text_handle, pytest.raises(ImageError, match="binary mode"):
        load_image(text_handle)
    as_255 = pixels.astype(np.float32)  # floats in [0, 255] and in [0, 1] give the same picture
    assert np.array_equal(np.asarray(load_image(as_255)), np.asarray(load_image(as_255 / 255.0)))
    for array, message in [(pixels.astype(np.float32) * 4, r"\[0, 1\] or \[0, 255\]"),
                           (pixels.astype(np.int32) - 300, r"\[0, 65535\]"),
                           (np.transpose(pixels, (2, 0, 1)), "transpose"),
                           (np.zeros(10), "H×W")]:
        with pytest.raises(ImageError, match=message):
            load_image(array)
    with pytest.raises(ImageError, match="not fetched"):
        load_image("https://example.com/cat.png")
    with pytest.raises(ImageError, match="folder"):
        load_image(tmp_path)
    with pytest.raises(ImageError, match="unsupported image type int"):
        load_image(7)
    with pytest.raises(TypeError, match="must be a string"):
        pipelines("tiny-qwen3-vl").answer(picture, 42)


def test_image_modes_become_rgb():
    gray = np.linspace(0, 1, 64 * 64).reshape(64, 64)
    assert load_image(gray).mode == "RGB"
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    assert load_image(rgba).getpixel((0, 0)) == (255, 255, 255)  # transparent on white
    assert load_image((np.ones((8, 8)) * 40000).astype(np.uint16)).mode == "RGB"


def test_answer_needs_a_model_when_none_is_installed(monkeypatch):
    monkeypatch.delenv("POP_VLM_MODEL", raising=False)
    monkeypatch.setattr(pop_vlm.loading, "default_model_name", lambda: None)
    with pytest.raises(ValueError, match="POP_VLM_MODEL"):
        pop_vlm.answer(None, "hello")


@pytest.fixture(scope="module")
def saved_tiny_vlm(tmp_path_factory):
    from pop_vlm import zoo

    return zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("tiny-qwen3-vl"))


def test_load_saved_model_matches_in_memory_one(saved_tiny_vlm, pipelines, picture):
    loaded = pop_vlm.load(str(saved_tiny_vlm), device="cpu")
    memory = pipelines("tiny-qwen3-vl")
    assert loaded.answer(picture, QUESTION, max_new_tokens=5).token_ids == memory.answer(picture, QUESTION, max_new_tokens=5).token_ids


def test_cli_answer_prints_answers_and_timings(saved_tiny_vlm, picture, tmp_path, capsys):
    image = tmp_path / "p.png"
    picture.save(image)
    code = cli_main(["answer", "--model", str(saved_tiny_vlm), "--image", str(image), "--question", QUESTION,
                     "--mode", "all", "--prune-layers", "2", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0
    for mode in ("[full]", "[pop]", "[static]", "TTFT", "prefill"):
        assert mode in out
    code = cli_main(["answer", "--model", str(saved_tiny_vlm), "--image", str(tmp_path / "nope.png"), "--question", "hi"])
    assert code == 2 and "not found" in capsys.readouterr().err


def test_shipped_importance_profile_makes_auto_work(saved_tiny_vlm, picture, tmp_path):
    import shutil

    folder = tmp_path / "with-profile"
    shutil.copytree(saved_tiny_vlm, folder)
    plain = pop_vlm.load(str(folder), device="cpu")
    with pytest.raises(ValueError, match="importance"):
        plain.answer(picture, QUESTION, pop=PopConfig(prune_layers="auto"), max_new_tokens=2)
    profile = plain.importance(n_prompts=2, samples_per_prompt=1, prompt_tokens=24, answer_tokens=4)
    profile.to_json(folder / "importance.json")
    loaded = pop_vlm.load(str(folder), device="cpu")
    assert loaded.auto_k == profile.auto_k()
    answer = loaded.answer(picture, QUESTION, pop=PopConfig(prune_layers="auto"), max_new_tokens=2)
    assert len(answer.pruned_layers) == profile.auto_k()
