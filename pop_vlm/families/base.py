"""What a model-family adapter provides to the engine and to the rest of the library.

The engine never calls a Hugging Face model's `forward`. It drives the decoder layers itself, one stage at a
time, and asks the family adapter for the family-specific parts: how a prompt is embedded (vision tower
included), how positions and rotary embeddings are laid out, which attention mask each layer needs, what is
added after a layer (Qwen3-VL's deepstack), and how a layer's K/V projection looks. The decoder layers, the
caches and the mask builders are transformers' own, so `mode="full"` is the plain model.

Everything else that is specific to a family is asked of its adapter too, so that adding a family touches its file
and the registry line in `families/__init__.py` (and, for the benchmark, its published config in `archs.py`):
which architectures it accepts and which of them take images, how its processor is loaded, which attention
implementation it runs, which tensors identify a prompt's images, which modules carry a layer's residual branches
(the importance gates), how the benchmark builds its config and inputs, and its tiny random test models.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..cache import PreallocatedCache
from ..numerics import FusedKVProjection, apply_rope

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass
class Prompt:
    """A prompt ready for the decoder stack: token ids, merged embeddings and positions of all N tokens."""

    input_ids: torch.Tensor  # (1, N)
    embeds: torch.Tensor  # (1, N, D), image features already merged in
    positions: torch.Tensor  # the family's position layout for all N tokens
    image_mask: torch.Tensor | None = None  # (1, N) bool: image placeholder positions
    extras: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def n_image_tokens(self) -> int:
        return 0 if self.image_mask is None else int(self.image_mask.sum())


class FamilyAdapter:
    """Base adapter: Llama-style decoders need nothing more than this."""

    name = "base"
    architectures: tuple[str, ...] = ()
    #: the architectures of this family that take images (their processor is an AutoProcessor)
    vlm_architectures: tuple[str, ...] = ()
    #: the processor's tensors that identify a prompt's images (the prefix cache's key)
    image_input_keys: tuple[str, ...] = ("pixel_values",)
    #: RMSNorm multiplies by (offset + weight): 0 for Llama/Qwen, 1 for Gemma.
    norm_weight_offset = 0.0
    #: image tokens attend to their whole image, both ways (Gemma-3): a prefill segment must not split an image
    bidirectional_image_blocks = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.decoder = self._find_decoder(model)
        self.config = self.decoder.config
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        layer_types = getattr(self.config, "layer_types", None)
        self.layer_types: list[str] = list(layer_types) if layer_types else [FULL] * self.num_layers
        self._fused_kv: dict[tuple[int, ...], FusedKVProjection] = {}

    # ---- before a model exists: loading, benchmark inputs, tiny test models ---------------------------------
    @classmethod
    def attention_implementation(cls, device: torch.device, architecture: str) -> str:
        """flash-attention-2 on CUDA when installed, else PyTorch's SDPA."""
        if device.type == "cuda":
            try:
                import flash_attn  # noqa: F401

                return "flash_attention_2"
            except ImportError:
                pass
        return "sdpa"

    @classmethod
    def load_processor(cls, path, architecture: str, trust_remote_code: bool = False):
        """The processor of a VLM, the tokenizer of a text model."""
        from transformers import AutoProcessor, AutoTokenizer

        loader = AutoProcessor if architecture in cls.vlm_architectures else AutoTokenizer
        return loader.from_pretrained(path, trust_remote_code=trust_remote_code)

    @classmethod
    def bench_config(cls, spec: dict, scale: float, vocab: int | None):
        """(Hugging Face config, special token ids) of a published architecture (`archs.py`) at width `scale`."""
        raise NotImplementedError(f"{cls.name} has no benchmark config builder")

    @classmethod
    def bench_image_processor(cls, model):
        """The image processor the benchmark feeds this model's images through (None: text only)."""
        return None

    @classmethod
    def bench_processor(cls, model):
        """A processor (tokenizer, and image processor for VLMs) for a model of `archs.build` with its real
        vocabulary, built offline, so that the model can be saved and served like a downloaded one."""
        raise NotImplementedError(f"{cls.name} has no offline processor for benchmark models")

    @classmethod
    def bench_prompt_ids(cls, model, special: dict, head: list[int], tail: list[int], pixels: dict | None) -> list[int]:
        """Token ids of a benchmark prompt: text `head`, the image's tokens when `pixels` is given, text `tail`."""
        return ([special["bos"]] if "bos" in special else []) + head + tail

    @classmethod
    def tiny_models(cls) -> dict:
        """Tiny random models of this family's real classes: name -> builder returning (model, processor)."""
        return {}

    # ---- what every family answers -------------------------------------------------------------------------
    def _find_decoder(self, model: nn.Module) -> nn.Module:
        return model.model

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def protected_layers(self) -> frozenset[int]:
        """Layers that must never be pruned."""
        return frozenset()

    @property
    def is_multimodal(self) -> bool:
        return False

    def new_cache(self) -> DynamicCache:
        """A `DynamicCache` whose full-attention layers write into preallocated storage (no torch.cat growth)."""
        return PreallocatedCache(config=self.config)

    def encode(self, inputs: dict, start: int = 0) -> Prompt:
        """Embed a processor's output (running the vision tower if there is an image).

        With `start` > 0 the first `start` tokens are already in the cache: images that lie wholly before it are
        not encoded again (their placeholder embeddings are never read)."""
        input_ids = _single_sequence(inputs)
        embeds = self.decoder.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return Prompt(input_ids=input_ids, embeds=embeds, positions=positions)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids)

    def positions_between(self, prompt: Prompt, start: int, end: int) -> torch.Tensor:
        """Positions of prompt tokens [start, end)."""
        return prompt.positions[..., start:end]

    def decode_positions(self, prompt: Prompt, index: int, length: int = 1) -> torch.Tensor:
        """Positions of `length` tokens that follow the prompt, the first at sequence index `index`."""
        device = prompt.input_ids.device
        return torch.arange(index, index + length, device=device)[None]

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for each layer type."""
        cos_sin = self.decoder.rotary_emb(hidden, positions)
        return {layer_type: cos_sin for layer_type in set(self.layer_types)}

    def after_layer(self, index: int, hidden: torch.Tensor, prompt: Prompt | None, span: tuple[int, int] | None):
        """Hook run on the output of layer `index` (prompt tokens [span) or a decode token when span is None)."""
        return hidden

    def masks(self, hidden, cache, layer_ids, prompt: Prompt | None, span: tuple[int, int] | None) -> dict:
        """Attention mask of each layer in `layer_ids` for the tokens in `hidden`.

        Layers are grouped by type and by how many tokens their cache holds (they differ when a POP ablation
        leaves skipped layers without prompt keys); one mask is built per group, sized against that group.
        """
        groups: dict[tuple[str, int], list[int]] = {}
        for i in layer_ids:
            groups.setdefault((self.layer_types[i], cache.get_seq_length(i)), []).append(i)
        out = {}
        for (layer_type, _), ids in groups.items():
            mask = self._mask(layer_type, ids[0], hidden, cache, prompt, span)
            out.update({i: mask for i in ids})
        return out

    def _mask(self, layer_type, layer_idx, hidden, cache, prompt, span):
        build = create_sliding_window_causal_mask if layer_type == SLIDING else create_causal_mask
        return build(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=cache, position_ids=None,
            layer_idx=layer_idx,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (and the family's logit soft-capping) on the given positions only."""
        logits = self.lm_head(self.decoder.norm(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- running layers ---------------------------------------------------------------------------------
    def run_layers(self, hidden, positions, cache, layer_ids, prompt=None, span=None):
        """Run `hidden` through the layers `layer_ids` in order, writing their KV into `cache`."""
        rope = self.rotary(hidden, positions)
        masks = self.masks(hidden, cache, layer_ids, prompt, span)
        for i in layer_ids:
            hidden = self.layers[i](
                hidden,
                attention_mask=masks[i],
                position_embeddings=rope[self.layer_types[i]],
                position_ids=None,
                cache=cache,
            )
            hidden = self.after_layer(i, hidden, prompt, span)
        return hidden

    def branch_modules(self, layer: nn.Module) -> list[nn.Module]:
        """The modules whose outputs are a decoder layer's residual branches (the importance gates' places):
        the outputs of self_attn (its first element) and mlp."""
        return [layer.self_attn, layer.mlp]

    # ---- K/V projection of a layer (POP's independent KV) -------------------------------------------------
    def input_norm(self, index: int) -> nn.Module:
        return self.layers[index].input_layernorm

    def k_norm(self, index: int) -> nn.Module | None:
        return getattr(self.layers[index].self_attn, "k_norm", None)

    def project_kv(self, index: int, hidden: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference (unfused) K/V of layer `index` for `hidden`: K = RoPE(k_norm(W_K·norm(h))), V = W_V·norm(h)."""
        attn = self.layers[index].self_attn
        x = self.input_norm(index)(hidden)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        keys = attn.k_proj(x).view(shape)
        k_norm = self.k_norm(index)
        if k_norm is not None:
            keys = k_norm(keys)
        keys = keys.transpose(1, 2)
        values = attn.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = rope[self.layer_types[index]]
        return apply_rope(keys, cos, sin), values

    def fused_kv(self, layer_ids: tuple[int, ...]) -> FusedKVProjection:
        """The fused projection for this set of skipped layers, built once and kept."""
        if layer_ids not in self._fused_kv:
            self._fused_kv[layer_ids] = FusedKVProjection(self, layer_ids)
        return self._fused_kv[layer_ids]


def _single_sequence(inputs: dict) -> torch.Tensor:
    input_ids = inputs["input_ids"]
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"one prompt at a time: input_ids must have shape (1, N), got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return input_ids


def randomise_norms(model: nn.Module, scale: float = 0.3, offset: float = 0.0) -> None:
    """Tiny test models: random RMSNorm weights (offset + N(0, scale)), so that tests see each norm's effect
    (Gemma initialises its (1 + w) weights to zero, Llama its w to one)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.normal_(0.0, scale).add_(offset)
