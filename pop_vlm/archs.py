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
    """The Hugging Face config of `name` at width `scale` (and vocabulary `vocab`, default the real one), with the
    special token ids the benchmark's prompts need; the family's adapter builds it."""
    from .families import adapter_class_for

    if name not in ARCHS:
        raise ValueError(f"unknown architecture {name!r}; choose one of {', '.join(ARCHS)}")
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"--scale must lie in (0, 1], got {scale}")
    spec = copy.deepcopy(ARCHS[name])
    return adapter_class_for(spec["architecture"]).bench_config(spec, scale, vocab)


def build(name: str, scale: float = 1.0, vocab: int | None = None, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu", attn_implementation: str = "sdpa", seed: int = 0) -> Built:
    """`name` at width `scale` with random weights (the real class), on `device` in `dtype`, in eval mode."""
    import transformers

    from .families import adapter_class_for

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
                 is_multimodal=arch in adapter_class_for(arch).vlm_architectures)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_pretrained(name: str, directory, scale: float = 1.0, seed: int = 0):
    """`name` at width `scale` with random weights and its real vocabulary, saved with an offline processor (the
    family's `bench_processor`) to `directory`, which `pop_vlm.load` and `pop-vlm serve --model` then read.
    Returns the folder."""
    from pathlib import Path

    from .families import adapter_class_for

    built = build(name, scale=scale, vocab=None, seed=seed)
    processor = adapter_class_for(built.architecture).bench_processor(built.model)
    tokenizer = getattr(processor, "tokenizer", processor)
    built.model.generation_config.eos_token_id = tokenizer.eos_token_id  # random weights: ends only at max_tokens
    directory = Path(directory)
    built.model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
