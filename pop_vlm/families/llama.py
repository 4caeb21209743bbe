"""Llama-style text decoders: Llama, Qwen2, Qwen3 (k_norm on Qwen3, none on Llama/Qwen2)."""
from __future__ import annotations

from .base import FamilyAdapter


class LlamaAdapter(FamilyAdapter):
    name = "llama"
    architectures = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
