"""Which layers a prefill can skip: virtual-gate Fisher importance per stage, and ShortGPT's Block Influence.

**The virtual gate.** Every decoder layer gets two scalar gates, both equal to one (so the model is unchanged):
``g_pre[l]`` multiplies the layer's residual branches — attention and MLP, ``h + g·attn(...)``,
``h + g·mlp(...)``; for Gemma the branch output after its post-norm — at *prefill positions* (the prompt tokens
x_1..x_{N-1} that POP runs through the pruned stack), ``g_dec[l]`` multiplies them at the positions that POP
runs through all layers (the last prompt token and the answer tokens). The gates are forward hooks on the
Hugging Face layers' own attention/MLP (or post-norm) modules; transformers is not modified.

**Importance** is the Fisher information of a gate at g = 1:

    I_stage[l] = ½ · E[(∂ℓ/∂g_stage[l])²],   ℓ = −Σ_t log p(y_t | x, y_<t)  over the answer positions,

with labels y_t *sampled from the model's own distribution* at each answer position (the true Fisher, not the
empirical one), several label draws per prompt, one forward and one backward per draw, averaged over the
calibration set. The loss only covers answer positions — prompt tokens' own predictions are never used — so
the prefill gate measures how much a layer's work on the prompt matters to the answer through the KV cache.
(The last layer's prefill importance is exactly zero: its prompt-position outputs reach no answer token.)

**Block Influence** (ShortGPT, Men et al. 2024) is the stage-agnostic profile 1 − cos(layer input, layer
output), averaged over all tokens.

**"auto"** (`LayerImportance.auto_k`): the deepest suffix of layers whose summed prefill importance is at most
``budget`` (default 2 %) of the total prefill importance, never containing a protected layer (Qwen3-VL's
deepstack layers) and never longer than L/2.

Calibration text is real English that exists offline: the documentation topics that CPython ships in
``pydoc_data.topics``.
"""
from __future__ import annotations

import json
import os
import random
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import torch

from .families.base import FamilyAdapter

DEFAULT_BUDGET = 0.02


# ---- calibration text -------------------------------------------------------------------------------------------
def pydoc_corpus() -> str:
    """CPython's English documentation topics (``pydoc_data.topics``), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def text_passages(n: int, n_chars: int, seed: int = 0) -> list[str]:
    """`n` passages of about `n_chars` characters from random places of the pydoc corpus (seeded)."""
    corpus = pydoc_corpus()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, max(1, len(corpus) - n_chars))
        # start at a word boundary
        start = corpus.find(" ", start) + 1
        out.append(corpus[start:start + n_chars])
    return out


# ---- the result ---------------------------------------------------------------------------------------------
@dataclass
class LayerImportance:
    """Per-layer importance: `prefill` and `decode` (virtual-gate Fisher), `block_influence` (ShortGPT)."""

    prefill: list[float]
    decode: list[float]
    block_influence: list[float]
    model: str = ""
    protected: list[int] = field(default_factory=list)
    n_prompts: int = 0
    n_samples: int = 0
    settings: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.prefill)

    def share(self, stage: str) -> list[float]:
        """A stage's importance as fractions of its total."""
        values = self._stage(stage)
        total = sum(values)
        return [v / total if total > 0 else 0.0 for v in values]

    def _stage(self, stage: str) -> list[float]:
        if stage not in ("prefill", "decode", "block_influence"):
            raise ValueError(f"unknown stage {stage!r}; use prefill, decode or block_influence")
        return list(getattr(self, stage))

    def auto_k(self, budget: float = DEFAULT_BUDGET, max_fraction: float = 0.5) -> int:
        """The prefill pruning depth for ``prune_layers="auto"``.

        k is the largest number such that the deepest k layers (1) together hold at most `budget` of the total
        prefill importance, (2) contain no protected layer, and (3) number at most ``max_fraction · L``.
        """
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"budget must be a fraction in [0, 1], got {budget}")
        share = self.share("prefill")
        limit = int(self.num_layers * max_fraction)
        k, spent = 0, 0.0
        for layer in range(self.num_layers - 1, -1, -1):
            if self.num_layers - layer > limit or layer in self.protected:
                break
            spent += share[layer]
            if spent > budget + 1e-12:
                break
            k += 1
        return k

    def as_table(self) -> list[dict]:
        """One row per layer, for display: raw values and each stage's share of its total."""
        pre, dec, bi = self.share("prefill"), self.share("decode"), self.block_influence
        return [
            {"layer": i, "prefill": self.prefill[i], "decode": self.decode[i], "prefill_share": pre[i],
             "decode_share": dec[i], "block_influence": bi[i] if i < len(bi) else float("nan"),
             "protected": i in self.protected}
            for i in range(self.num_layers)
        ]

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps({**asdict(self), "auto_k": self.auto_k(self.settings.get("budget", DEFAULT_BUDGET))}, indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "LayerImportance":
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            with open(text_or_path) as f:
                text = f.read()
        data = json.loads(text)
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


# ---- the virtual gates -------------------------------------------------------------------------------------------
class VirtualGates:
    """Two scalar gates per layer (prefill positions, decode positions), applied by forward hooks.

    Set `prefill_positions` (a bool tensor over the sequence, True where the prefill gate applies) before a
    forward; with it unset the hooks do nothing.
    """

    def __init__(self, adapter: FamilyAdapter, dtype=torch.float32):
        device = next(adapter.model.parameters()).device
        self.adapter = adapter
        self.prefill = torch.ones(adapter.num_layers, device=device, dtype=dtype, requires_grad=True)
        self.decode = torch.ones(adapter.num_layers, device=device, dtype=dtype, requires_grad=True)
        self.prefill_positions: torch.Tensor | None = None
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.prefill_positions is None:
                return output
            branch = output[0] if isinstance(output, tuple) else output
            gate = torch.where(self.prefill_positions, self.prefill[index], self.decode[index]).to(branch.dtype)
            if gate.shape[0] != branch.shape[-2]:
                raise RuntimeError(f"the gate covers {gate.shape[0]} positions but the branch has {branch.shape[-2]}")
            branch = branch * gate[:, None]
            return (branch, *output[1:]) if isinstance(output, tuple) else branch

        return hook

    def __enter__(self) -> "VirtualGates":
        for i, layer in enumerate(self.adapter.layers):
            for module in self.adapter.branch_modules(layer):
                self._handles.append(module.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.prefill_positions = None


class BlockInfluence:
    """Accumulates 1 − cos(layer input, layer output) per layer over all tokens it sees."""

    def __init__(self, adapter: FamilyAdapter):
        self.adapter = adapter
        self.total = [0.0] * adapter.num_layers
        self.count = [0] * adapter.num_layers
        self.active = False
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, kwargs, output):
            if not self.active:
                return
            inp = args[0] if args else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(inp.detach().float(), out.detach().float(), dim=-1)
            self.total[index] += float((1.0 - cos).sum())
            self.count[index] += cos.numel()

        return hook

    def __enter__(self) -> "BlockInfluence":
        for i, layer in enumerate(self.adapter.layers):
            self._handles.append(layer.register_forward_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def values(self) -> list[float]:
        return [t / c if c else 0.0 for t, c in zip(self.total, self.count)]


@contextmanager
def frozen_parameters(model: torch.nn.Module):
    """No parameter requires grad inside (the backward then only reaches the gates)."""
    states = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in states:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, state in states:
            p.requires_grad_(state)


# ---- calibration samples -------------------------------------------------------------------------------------
@dataclass
class CalibrationSample:
    """A prompt (processor output) and the answer tokens that follow it."""

    inputs: dict
    answer_ids: list[int]


def extend_inputs(inputs: dict, extra_ids: Sequence[int]) -> dict:
    """The processor output with `extra_ids` appended as plain text tokens."""
    ids = inputs["input_ids"]
    n = ids.shape[1]
    extra = torch.tensor([list(extra_ids)], dtype=ids.dtype, device=ids.device)
    out = dict(inputs)
    out["input_ids"] = torch.cat([ids, extra], dim=1)
    for key, value in inputs.items():
        if key == "input_ids" or not isinstance(value, torch.Tensor) or value.ndim != 2 or value.shape != (1, n):
            continue
        fill = 1 if key == "attention_mask" else 0
        out[key] = torch.cat([value, torch.full((1, len(extra_ids)), fill, dtype=value.dtype, device=value.device)], 1)
    return out


def text_samples(tokenizer, n_prompts: int = 8, prompt_tokens: int = 192, answer_tokens: int = 32,
                 seed: int = 0, device="cpu") -> list[CalibrationSample]:
    """Calibration samples from the pydoc corpus: the first `prompt_tokens` tokens of a passage are the prompt
    (with the tokenizer's special tokens, e.g. <bos>), the next `answer_tokens` real tokens are the answer."""
    samples = []
    for passage in text_passages(n_prompts, (prompt_tokens + answer_tokens) * 8, seed):
        ids = tokenizer(passage, return_tensors="pt").input_ids[0].tolist()
        if len(ids) < prompt_tokens + answer_tokens:
            raise ValueError("a calibration passage is shorter than prompt_tokens + answer_tokens")
        prompt = torch.tensor([ids[:prompt_tokens]], device=device)
        samples.append(CalibrationSample({"input_ids": prompt}, ids[prompt_tokens:prompt_tokens + answer_tokens]))
    return samples


def _as_sample(pipe, item, answer_tokens: int) -> CalibrationSample:
    """A text, an (image, question) or (image, question, answer) tuple, or a CalibrationSample."""
    if isinstance(item, CalibrationSample):
        return item
    if isinstance(item, dict) and "question" in item:
        item = (item.get("image"), item["question"], item.get("answer"))
    if isinstance(item, str):
        item = (None, item, None)
    image, question, *rest = item
    answer = rest[0] if rest else None
    inputs = pipe.build_inputs(image, question)
    if answer:
        answer_ids = pipe.tokenizer(answer, add_special_tokens=False).input_ids
    else:  # the model's own greedy answer
        answer_ids = pipe.generate(inputs, mode="full", max_new_tokens=answer_tokens).token_ids
    return CalibrationSample(inputs, list(answer_ids)[:answer_tokens])


# ---- the estimator -----------------------------------------------------------------------------------------------
def gated_loss(adapter: FamilyAdapter, gates: VirtualGates, sample: CalibrationSample, labels: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over prompt + answer with the gates in place; returns (loss, labels).

    The prefill gates act on prompt positions [0, N-1), the decode gates on [N-1, N+T). The loss is the
    negative log-likelihood of `labels` at the T answer positions; labels not given are drawn from the
    model's own predictive distribution there.
    """
    n = sample.inputs["input_ids"].shape[1]
    inputs = extend_inputs(sample.inputs, sample.answer_ids)
    with torch.no_grad():
        prompt = adapter.encode(inputs)
    total = prompt.length
    gates.prefill_positions = torch.arange(total, device=prompt.embeds.device) < n - 1
    hidden = adapter.run_layers(prompt.embeds, adapter.positions_between(prompt, 0, total), adapter.new_cache(),
                                range(adapter.num_layers), prompt=prompt, span=(0, total))
    logits = adapter.logits(hidden[:, n - 1:total - 1])[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 for the loss
    if labels is None:
        probs = torch.softmax(logits.detach(), -1)
        labels = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)
    loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    return loss, labels


def compute_importance(pipe, samples: Iterable | None = None, *, n_prompts: int = 8, samples_per_prompt: int = 4,
                       prompt_tokens: int = 192, answer_tokens: int = 32, seed: int = 0, budget: float = DEFAULT_BUDGET,
                       progress: bool = False) -> LayerImportance:
    """Virtual-gate Fisher importance (prefill and decode) and Block Influence for a `Pipeline`.

    samples: texts, (image, question[, answer]) tuples, or `CalibrationSample`s; None takes `n_prompts`
    passages of the pydoc corpus (`prompt_tokens` prompt + `answer_tokens` answer tokens each).
    Each prompt gets `samples_per_prompt` label draws (one forward and one backward each).
    """
    adapter = pipe.adapter
    if samples is None:
        calibration = text_samples(pipe.tokenizer, n_prompts, prompt_tokens, answer_tokens, seed, pipe.device)
    else:
        calibration = [_as_sample(pipe, item, answer_tokens) for item in samples]
    calibration = [s for s in calibration if s.answer_ids and s.inputs["input_ids"].shape[1] >= 2]
    if not calibration:
        raise ValueError("no usable calibration samples (each needs a prompt of two or more tokens and an answer)")
    generator = torch.Generator().manual_seed(seed)
    L = adapter.num_layers
    fisher_pre = torch.zeros(L, dtype=torch.float64)
    fisher_dec = torch.zeros(L, dtype=torch.float64)
    n = 0
    losses = []
    from tqdm.auto import tqdm

    bar = tqdm(total=len(calibration) * samples_per_prompt, desc="importance", disable=not progress)
    with frozen_parameters(adapter.model), VirtualGates(adapter) as gates, BlockInfluence(adapter) as influence:
        for sample in calibration:
            for draw in range(samples_per_prompt):
                influence.active = draw == 0  # Block Influence does not depend on the labels: once per prompt
                loss, _ = gated_loss(adapter, gates, sample, generator=generator)
                influence.active = False
                g_pre, g_dec = torch.autograd.grad(loss, [gates.prefill, gates.decode])
                fisher_pre += 0.5 * g_pre.double().cpu() ** 2
                fisher_dec += 0.5 * g_dec.double().cpu() ** 2
                losses.append(float(loss.detach()) / len(sample.answer_ids))
                n += 1
                bar.update()
        block_influence = influence.values()
    bar.close()
    return LayerImportance(
        prefill=(fisher_pre / n).tolist(), decode=(fisher_dec / n).tolist(), block_influence=block_influence,
        model=str(pipe.name), protected=sorted(adapter.protected_layers), n_prompts=len(calibration), n_samples=n,
        settings={"samples_per_prompt": samples_per_prompt, "prompt_tokens": prompt_tokens if samples is None else None,
                  "answer_tokens": answer_tokens, "seed": seed, "budget": budget,
                  "calibration": "pydoc_data.topics" if samples is None else "given samples",
                  "mean_sampled_nll_per_token": sum(losses) / len(losses)},
    )
