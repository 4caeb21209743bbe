"""Real model architectures, offline: the public `config.json` values of the benchmarked models, built with
random weights in the real Hugging Face classes.

`build(name, scale=S)` shrinks the widths (hidden and MLP sizes of the decoder and of the vision tower) by S while
keeping what decides POP's cost structure: the number of layers, the layer types (Gemma-3's 5 sliding : 1 global
pattern), the head dimension (so RoPE / M-RoPE sections stay valid) and the grouped-query ratio (head counts are
scaled with the width, at least one KV head). `vocab` shrinks the vocabulary: the LM head runs on one position
in every mode, so its cost is the same for full, POP and static; a smaller table only makes CPU runs lighter.
At scale 1 with the real vocabulary the models have the published parameter counts.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

# ---- public config.json values ---------------------------------------------------------------------------------
QWEN3_VL_2B = {
    "architecture": "Qwen3VLForConditionalGeneration",
    "hub_id": "Qwen/Qwen3-VL-2B-Instruct",
    "text_config": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2048,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
        "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17],
    },
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": True,
}

QWEN3_VL_8B = {
    "architecture": "Qwen3VLForConditionalGeneration",
    "hub_id": "Qwen/Qwen3-VL-8B-Instruct",
    "text_config": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 4096,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
        "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    },
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
}

GEMMA_3_4B = {
    "architecture": "Gemma3ForConditionalGeneration",
    "hub_id": "google/gemma-3-4b-it",
    "text_config": {
        "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "sliding_window": 1024, "sliding_window_pattern": 6,  # layer_types: 5 sliding, then 1 global
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    },
    "vision_config": {
        "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
        "image_size": 896, "patch_size": 14, "num_channels": 3, "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6, "vision_use_head": False,
    },
    "mm_tokens_per_image": 256, "image_token_id": 262144, "boi_token_id": 255999, "eoi_token_id": 256000,
}

LLAMA_31_8B = {
    "architecture": "LlamaForCausalLM",
    "hub_id": "meta-llama/Llama-3.1-8B",
    "config": {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
}

ARCHS = {
    "qwen3-vl-2b": QWEN3_VL_2B,
    "qwen3-vl-8b": QWEN3_VL_8B,
    "gemma-3-4b": GEMMA_3_4B,
    "llama-3.1-8b": LLAMA_31_8B,
}


def text_config_dict(name: str) -> dict:
    spec = ARCHS[name]
    return dict(spec.get("text_config") or spec["config"])


# ---- scaling -------------------------------------------------------------------------------------------------
def _width(value: int, scale: float, multiple: int = 32) -> int:
    return max(multiple, int(round(value * scale / multiple)) * multiple)


def _heads(heads: int, kv_heads: int, scale: float) -> tuple[int, int]:
    """Scale the head counts with the width, keeping the grouped-query ratio while at least one KV head is left."""
    group = heads // kv_heads
    scaled = max(1, int(round(heads * scale)))
    if scaled < group:  # too narrow for a whole group: one KV head shared by all query heads
        return scaled, 1
    kv = max(1, int(round(kv_heads * scale)))
    return kv * group, kv


def scale_text(cfg: dict, scale: float, vocab: int | None) -> dict:
    cfg = copy.deepcopy(cfg)
    if scale != 1.0:
        heads, kv = _heads(cfg["num_attention_heads"], cfg["num_key_value_heads"], scale)
        cfg["num_attention_heads"], cfg["num_key_value_heads"] = heads, kv
        cfg["hidden_size"] = _width(cfg["hidden_size"], scale, multiple=max(32, heads))
        cfg["intermediate_size"] = _width(cfg["intermediate_size"], scale)
    if vocab:
        cfg["vocab_size"] = int(vocab)
    return cfg


def _scale_vision_heads(hidden: int, heads: int, scale: float) -> tuple[int, int]:
    head_dim = hidden // heads
    new_heads = max(1, int(round(heads * scale)))
    return new_heads * head_dim, new_heads


@dataclass
class Built:
    """A randomly initialised model of a real architecture, with what the benchmark needs to feed it."""

    name: str
    model: torch.nn.Module
    architecture: str
    special: dict = field(default_factory=dict)  # token ids: image, vision_start/end, boi/eoi, bos
    vocab_size: int = 0
    is_multimodal: bool = False

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def text_config(self):
        return getattr(self.model.config, "text_config", self.model.config)


def make_config(name: str, scale: float = 1.0, vocab: int | None = None):
    """The Hugging Face config of `name` at width `scale` (and vocabulary `vocab`, default the real one)."""
    import transformers

    if name not in ARCHS:
        raise ValueError(f"unknown architecture {name!r}; choose one of {', '.join(ARCHS)}")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"--scale must lie in (0, 1], got {scale}")
    spec = copy.deepcopy(ARCHS[name])
    arch = spec["architecture"]
    if arch == "LlamaForCausalLM":
        cfg = scale_text(spec["config"], scale, vocab)
        if vocab:
            cfg["bos_token_id"], cfg["eos_token_id"] = cfg["vocab_size"] - 2, cfg["vocab_size"] - 1
        return transformers.LlamaConfig(**cfg), {"bos": cfg["bos_token_id"]}
    text = scale_text(spec["text_config"], scale, vocab)
    v = text["vocab_size"]
    vision = spec["vision_config"]
    if arch == "Qwen3VLForConditionalGeneration":
        if scale != 1.0:
            vision["hidden_size"], vision["num_heads"] = _scale_vision_heads(vision["hidden_size"], vision["num_heads"], scale)
            vision["intermediate_size"] = _width(vision["intermediate_size"], scale)
        vision["out_hidden_size"] = text["hidden_size"]
        ids = {k: spec[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
        if vocab:  # the special tokens move to the top of the shrunk vocabulary
            ids = {k: v - 1 - i for i, k in enumerate(ids)}
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision,
                                            tie_word_embeddings=text["tie_word_embeddings"], **ids)
        return config, {"image": ids["image_token_id"], "vision_start": ids["vision_start_token_id"],
                        "vision_end": ids["vision_end_token_id"]}
    # Gemma-3
    if scale != 1.0:
        vision["hidden_size"], vision["num_attention_heads"] = _scale_vision_heads(
            vision["hidden_size"], vision["num_attention_heads"], scale)
        vision["intermediate_size"] = _width(vision["intermediate_size"], scale)
    ids = {k: spec[k] for k in ("image_token_id", "boi_token_id", "eoi_token_id")}
    if vocab:
        ids = {k: v - 1 - i for i, k in enumerate(ids)}
    pattern = text.pop("sliding_window_pattern")
    text["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(text["num_hidden_layers"])]
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**text).to_dict(),
        vision_config=transformers.SiglipVisionConfig(**vision).to_dict(),
        mm_tokens_per_image=spec["mm_tokens_per_image"], **ids,
    )
    return config, {"image": ids["image_token_id"], "boi": ids["boi_token_id"], "eoi": ids["eoi_token_id"], "bos": 2}


def build(name: str, scale: float = 1.0, vocab: int | None = None, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu", attn_implementation: str = "sdpa", seed: int = 0) -> Built:
    """`name` at width `scale` with random weights (the real class), on `device` in `dtype`, in eval mode."""
    import transformers

    config, special = make_config(name, scale, vocab)
    arch = ARCHS[name]["architecture"]
    config._attn_implementation = attn_implementation
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            getattr(config, sub)._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else torch.float32)
    try:
        with torch.device(device):
            model = getattr(transformers, arch)(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(device=device, dtype=dtype).eval()
    text = getattr(config, "text_config", config)
    return Built(name=name, model=model, architecture=arch, special=special, vocab_size=text.vocab_size,
                 is_multimodal=arch != "LlamaForCausalLM")


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
