"""The page's examples fit the selected model: canvases for a bundled shapes model, no image for a text model,
photos (and canvases) for a general vision-language model."""
from __future__ import annotations

from pathlib import Path

from app.models import ModelManager
from app.ui import example_kind, examples


def test_examples_fit_each_kind_of_model():
    shapes, text, photo = examples("shapes"), examples("text"), examples("photo")
    assert shapes and text and photo
    assert all(image and Path(image).name.startswith("shapes_") for image, _ in shapes)
    assert all(image is None and question for image, question in text)
    photo_names = {Path(image).name for image, _ in photo}
    assert {"chelsea.jpg", "astronaut.jpg"} <= photo_names
    assert not any(name.endswith(".jpg") for name in (Path(image).name for image, _ in shapes))


def test_example_kind_from_the_name_or_the_loaded_pipeline(tmp_path):
    from pop_vlm import zoo

    text_dir = zoo.save_tiny("tiny-qwen3", tmp_path / "text")
    vlm_dir = zoo.save_tiny("tiny-qwen3-vl", tmp_path / "vlm")
    manager = ModelManager(str(text_dir), device="cpu", served=[str(text_dir), str(vlm_dir)])
    assert example_kind(manager, "shapes-qwen3-vl") == "shapes"
    assert example_kind(manager, "gemma-3-270m") == "text"
    assert example_kind(manager, str(text_dir)) == "photo"  # not loaded yet: nothing known but the name
    manager.get(str(text_dir))
    manager.get(str(vlm_dir))
    assert example_kind(manager, str(text_dir)) == "text"
    assert example_kind(manager, str(vlm_dir)) == "photo"


def test_the_importance_chart_numbers_layers_as_whole_numbers():
    from app.charts import importance_chart

    fig = importance_chart([0.5, 0.3, 0.1] * 6, [0.05] * 18, pruned=[15, 16, 17])
    ticks = [t for t in fig.axes[0].get_xticks() if 0 <= t <= 17]
    assert ticks and all(float(t).is_integer() for t in ticks)
