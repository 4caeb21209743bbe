"""Low-rank adapters on the frozen pretrained language model of a demo model (`--lora-rank`, family `gemma3`).

Each target Linear of every decoder layer (weight W: out x in, frozen) gets two trainable matrices, A (R x in,
small random) and B (out x R, zeros), and computes W·x + (alpha/R)·B·A·x: at the start, exactly the pretrained
function. The adapted layer keeps the frozen weight under its own name and adds ``lora_A`` and ``lora_B`` beside it
(the names `pop_vlm.assembly` reads), so the trained state (`export.trained_state`) holds the adapters, a checkpoint
resumes them, and the shipped folder carries them in ``adapters.safetensors``; `pop_vlm.load` merges them into the
pretrained weights (W <- W + (alpha/R)·B·A), so the loaded model is a plain one, with no adapter modules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import assembly

# The plan that calls for adapters caps their rank at 16: a small correction of the pretrained model, not a
# second model beside it (rank 16 on q, k, v, o of the 270M is 1.5M weights, 0.6% of it).
MAX_RANK = 16
# --lora-targets names -> the decoder layers' Linear modules (attention, then MLP)
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}
DEFAULT_TARGETS = "q,k,v,o"


@dataclass(frozen=True)
class Settings:
    """Rank, alpha (the update is scaled by alpha / rank) and the target modules (``q_proj`` ...)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def description(self) -> dict:
        """As `base_model.json` and the checkpoint record it."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def target_names(spec: str) -> list[str]:
    """``"q,k,v,o"`` -> the short names, unknown ones included (`options_problem` reports them)."""
    return [name.strip() for name in spec.split(",") if name.strip()]


def options_problem(args, family) -> str | None:
    """What is wrong with the adapter options, or None."""
    rank, alpha = args.lora_rank, args.lora_alpha
    if rank < 0 or rank > MAX_RANK:
        return f"--lora-rank must be between 0 (no adapters) and {MAX_RANK}, not {rank}"
    if rank == 0:
        if alpha is not None or args.lora_targets != DEFAULT_TARGETS:
            return "--lora-alpha and --lora-targets need --lora-rank > 0"
        return None
    if not getattr(family, "PRETRAINED", None):
        return f"--lora-rank: {family.MODEL_NAME}'s language model is trained whole; adapters are for a frozen one"
    if alpha is not None and not alpha > 0:
        return f"--lora-alpha must be > 0, not {alpha}"
    names = target_names(args.lora_targets)
    if unknown := [n for n in names if n not in TARGETS]:
        return f"--lora-targets: unknown {', '.join(unknown)}; choose among {','.join(TARGETS)}"
    if not names or len(set(names)) != len(names):
        return f"--lora-targets must name each target once: {args.lora_targets!r}"
    return None


def settings(args) -> Settings | None:
    """The run's adapters (checked options), or None without them. Alpha defaults to 2R: a scale of 2, the usual
    choice, which keeps the update's size comparable across ranks."""
    if not args.lora_rank:
        return None
    chosen = set(target_names(args.lora_targets))
    targets = tuple(module for short, module in TARGETS.items() if short in chosen)
    alpha = float(args.lora_alpha) if args.lora_alpha is not None else 2.0 * args.lora_rank
    return Settings(args.lora_rank, alpha, targets)


class LoraLinear(torch.nn.Module):
    """A frozen Linear plus a trainable low-rank update; its weight and bias are the wrapped Linear's own
    parameters, under the same names."""

    def __init__(self, linear: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        a = torch.empty(rank, self.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as a Linear's own weight starts
        setattr(self, assembly.ADAPTER_A, torch.nn.Parameter(a))
        setattr(self, assembly.ADAPTER_B, torch.nn.Parameter(torch.zeros(self.out_features, rank, dtype=a.dtype,
                                                                          device=a.device)))

    def forward(self, x):
        a, b = getattr(self, assembly.ADAPTER_A), getattr(self, assembly.ADAPTER_B)
        update = torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)
        return torch.nn.functional.linear(x, self.weight, self.bias) + self.scale * update

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha}"


def attach(model, family, adapters: Settings | None):
    """Put adapters on `adapters.targets` of every decoder layer of `model` (in place; returns it). Their A matrices
    draw from the global torch generator, after everything `family.new_model` drew."""
    if adapters is None:
        return model
    for index, layer in enumerate(family.text_layers(model)):
        found = {}
        for name, module in layer.named_modules():
            if name.rpartition(".")[2] in adapters.targets:
                found[name] = module
        if sorted(n.rpartition(".")[2] for n in found) != sorted(adapters.targets):
            raise ValueError(f"decoder layer {index} does not hold each of {', '.join(adapters.targets)} once: "
                             f"{sorted(found)}")
        for name, module in found.items():
            if type(module) is not torch.nn.Linear:
                raise ValueError(f"decoder layer {index}: {name} is a {type(module).__name__}, not a Linear")
            parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
            setattr(parent, name.rpartition(".")[2], LoraLinear(module, adapters.rank, adapters.alpha))
    return model


def adapted_modules(model) -> list[tuple[str, LoraLinear]]:
    """(name, module) of every adapted Linear of `model`."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLinear)]


def settings_of(model) -> Settings | None:
    """The adapters `model` carries, or None."""
    modules = [module for _, module in adapted_modules(model)]
    if not modules:
        return None
    kinds = {(m.rank, m.alpha) for m in modules}
    if len(kinds) != 1:
        raise ValueError(f"the model's adapters differ in rank or alpha: {sorted(kinds)}")
    rank, alpha = kinds.pop()
    present = {name.rpartition(".")[2] for name, _ in adapted_modules(model)}
    return Settings(rank, alpha, tuple(t for t in TARGETS.values() if t in present))


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter matrix."""
    return name.rpartition(".")[2] in (assembly.ADAPTER_A, assembly.ADAPTER_B)


def count(model) -> int:
    """Number of adapter weights in `model`."""
    return sum(p.numel() for name, p in model.named_parameters() if is_adapter(name))
