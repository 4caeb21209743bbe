"""Tiny models of the real Hugging Face classes, built once per test session (no downloads)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pop_vlm import Pipeline, zoo

torch.set_num_threads(1)

FAMILIES = list(zoo.TINY)  # every family's tiny models (each adapter names its own)
QUESTION = "What is in the picture? Describe it to me please, with the colour and the shape"


@pytest.fixture(scope="session")
def pipelines():
    cache = {}

    def get(name: str) -> Pipeline:
        if name not in cache:
            model, processor = zoo.TINY[name]()
            cache[name] = Pipeline(model, processor, name=name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def picture() -> Image.Image:
    rng = np.random.RandomState(0)
    return Image.fromarray((rng.rand(96, 128, 3) * 255).astype("uint8"))


def image_for(pipe: Pipeline, picture):
    return picture if pipe.is_multimodal else None
