"""Llama-style text decoders: Llama, Qwen2, Qwen3, Mistral (k_norm on Qwen3, none on the others)."""
from __future__ import annotations

import torch

from ..offline_tokenizers import qwen3_tokenizer
from ..scaling import scale_text
from .base import FamilyAdapter, randomise_norms


class LlamaAdapter(FamilyAdapter):
    name = "llama"
    architectures = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")

    @classmethod
    def bench_config(cls, spec: dict, scale: float, vocab: int | None):
        import transformers

        cfg = scale_text(spec["config"], scale, vocab)
        if vocab:  # bos and eos move to the top of the shrunk vocabulary
            cfg["bos_token_id"], cfg["eos_token_id"] = cfg["vocab_size"] - 2, cfg["vocab_size"] - 1
        config_class = getattr(transformers, spec["architecture"].replace("ForCausalLM", "Config"))
        return config_class(**cfg), {"bos": cfg["bos_token_id"]}

    @classmethod
    def tiny_models(cls) -> dict:
        return {"tiny-llama": lambda **kw: tiny_model("LlamaForCausalLM", **kw),
                "tiny-qwen3": lambda **kw: tiny_model("Qwen3ForCausalLM", **kw)}


def tiny_model(architecture: str = "LlamaForCausalLM", num_layers: int = 6, seed: int = 0):
    """A Llama-style decoder (Llama, Qwen2 or Qwen3) with the real Qwen3 tokenizer; (model, tokenizer)."""
    import transformers

    tokenizer = qwen3_tokenizer()
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True, initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    randomise_norms(model, scale=0.1, offset=1.0)  # Llama-style norms multiply by w: keep them near one
    return model, tokenizer
