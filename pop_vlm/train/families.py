"""The model families the demo models can be trained in: `--family` name -> builder module of this package.

A builder (e.g. `qwen3_vl.py`) provides the processor, config, fresh model, packed inputs (`Encoder`) and model
card sections of its family; adding a family is one more builder file and its line here.
"""
from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = {"qwen3-vl": "qwen3_vl", "gemma3": "gemma3"}


def family(name: str) -> ModuleType:
    """The builder module of a model family, by its `--family` name."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__package__}.{FAMILIES[name]}")
