"""Loading: a hub id, a local folder or a zoo name into a `Pipeline` (device, dtype, the family's processor and
attention implementation, a shipped importance profile), and `answer`, the one-call API on the default model."""
from __future__ import annotations

import os

import torch

from .families import adapter_class_for
from .pipeline import Pipeline
from .results import Answer


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        # bf16 on GPUs; fp32 on CPUs, where bf16 matrix multiplies are several times slower
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bf16, fp16 or fp32")
    return names[dtype]


def load(name_or_path: str, device: str | torch.device = "auto", dtype="auto", *, trust_remote_code: bool = False) -> "Pipeline":
    """Load a hub id, a local folder, or a zoo name (see `pop_vlm.zoo`) into a `Pipeline`. A folder shipped without
    its pretrained language model (`pop_vlm.assembly`) is assembled with it, tokenizer included."""
    import transformers
    from transformers import AutoConfig

    from . import zoo

    path = zoo.resolve(name_or_path)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    family = adapter_class_for(architecture)  # a clear error for unsupported models, before any weights load
    attention = family.attention_implementation(device, architecture)
    processor_path = path
    if zoo.base_language_model(path) is not None:  # shipped without its pretrained language model
        from .assembly import load_model, processor_folder

        model = load_model(path, dtype=torch_dtype, attn_implementation=attention, name=name_or_path)
        processor_path = processor_folder(path)
    else:
        model = getattr(transformers, architecture).from_pretrained(
            path, dtype=torch_dtype, attn_implementation=attention, trust_remote_code=trust_remote_code,
            use_safetensors=True,
        )
    model = model.to(device).eval()
    processor = family.load_processor(processor_path, architecture, trust_remote_code=trust_remote_code)
    pipe = Pipeline(model, processor, name=name_or_path)
    profile = os.path.join(path, "importance.json")
    if os.path.isfile(profile):  # a shipped importance profile makes prune_layers="auto" work at once
        from .importance import LayerImportance

        pipe.auto_k = LayerImportance.from_json(profile).auto_k()
    return pipe


_DEFAULT: dict[str, Pipeline] = {}


def default_model_name() -> str | None:
    from . import zoo

    return os.environ.get("POP_VLM_MODEL") or zoo.default_model()


def answer(image, question: str, model: str | None = None, **kwargs) -> Answer:
    """Answer a question about an image with a cached pipeline (the default model unless `model` is given)."""
    name = model or default_model_name()
    if name is None:
        raise ValueError("no default model is available: pass model=... or set POP_VLM_MODEL")
    if name not in _DEFAULT:
        _DEFAULT[name] = load(name)
    return _DEFAULT[name].answer(image, question, **kwargs)
