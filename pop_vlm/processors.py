"""Processors that work without torchvision.

transformers' Qwen3-VL processor insists on a video processor, and the video processor needs torchvision,
which is not installable beside every torch build. Images need neither, so these classes build and load an
image-only processor from the same files `save_pretrained` writes.
"""
from __future__ import annotations

import os

from transformers import AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` that accepts `video_processor=None` (images and text only)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def save_pretrained(self, save_directory, **kwargs):
        """Write the tokenizer, the image processor and the chat template (what `load_qwen3_vl_processor` reads)."""
        os.makedirs(save_directory, exist_ok=True)
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)
        if self.chat_template:
            with open(os.path.join(save_directory, "chat_template.jinja"), "w", encoding="utf-8") as handle:
                handle.write(self.chat_template)
        return [save_directory]


def load_qwen3_vl_processor(path: str | os.PathLike):
    """Load a Qwen3-VL processor from a local folder, with or without torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path)
    except (ImportError, AttributeError, TypeError, ValueError, OSError):
        pass
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    chat_template = _read_chat_template(path) or tokenizer.chat_template
    return ImageOnlyQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template
    )


def _read_chat_template(path) -> str | None:
    """The processor's chat template (with image parts) from a local folder or, for a hub id, the hub's files."""
    import json

    for name in ("chat_template.jinja", "chat_template.json"):
        file = os.path.join(path, name)
        if not os.path.isfile(file) and not os.path.isdir(path):
            try:
                from huggingface_hub import hf_hub_download

                file = hf_hub_download(str(path), name)
            except Exception:  # noqa: BLE001 - the file may not exist in that repository
                continue
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as handle:
                return handle.read() if name.endswith(".jinja") else json.load(handle).get("chat_template")
    return None
