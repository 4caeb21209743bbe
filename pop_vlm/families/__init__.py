"""One adapter per model family, detected from the model's class or config."""
from __future__ import annotations

from .base import FamilyAdapter, Prompt
from .gemma3 import Gemma3Adapter
from .llama import LlamaAdapter
from .qwen3_vl import Qwen3VLAdapter

ADAPTERS: tuple[type[FamilyAdapter], ...] = (Qwen3VLAdapter, Gemma3Adapter, LlamaAdapter)


def supported_architectures() -> list[str]:
    return [arch for adapter in ADAPTERS for arch in adapter.architectures]


def adapter_class_for(architecture: str) -> type[FamilyAdapter]:
    for adapter in ADAPTERS:
        if architecture in adapter.architectures:
            return adapter
    raise ValueError(
        f"unsupported architecture {architecture!r}; pop-vlm supports: {', '.join(supported_architectures())}"
    )


def detect_family(model) -> FamilyAdapter:
    """The adapter for a loaded Hugging Face model."""
    names = [type(model).__name__, *(getattr(model.config, "architectures", None) or [])]
    for name in names:
        for adapter in ADAPTERS:
            if name in adapter.architectures:
                return adapter(model)
    return adapter_class_for(names[0])(model)  # raises with the list of supported architectures


__all__ = ["ADAPTERS", "FamilyAdapter", "Prompt", "adapter_class_for", "detect_family", "supported_architectures"]
