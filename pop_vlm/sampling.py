"""Picking the next token: greedy or sampled (temperature, top-k, top-p, seed), OpenAI's presence and frequency
penalties, and a token's log-probability with the step's most likely alternatives."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .results import TokenLogprob


@dataclass
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {value!r}")
        if self.temperature == 0.0:
            self.do_sample = False  # temperature 0 means greedy, as in OpenAI's API

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """OpenAI's penalties: logit_j - count_j * frequency_penalty - [count_j > 0] * presence_penalty, where count_j
    is how often token j was generated so far in this choice (the prompt does not count)."""
    counts = counts.to(logits.device, torch.float32)
    return logits.float() - counts * params.frequency_penalty - (counts > 0).float() * params.presence_penalty


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 counts: torch.Tensor | None = None) -> int:
    """Pick the next token from logits of shape (vocab,); `counts` (vocab,) are the choice's token counts so far,
    for the penalties."""
    if counts is not None and params.penalised:
        logits = apply_penalties(logits, counts, params)
    if not params.do_sample:
        return int(torch.argmax(logits))
    # float64, shifted so the best logit is 0: dividing by a tiny temperature (which float32 would round to 0)
    # then gives 0 and -inf, never inf - inf or 0 / 0 = nan
    logits = logits.double()
    logits = (logits - logits.max()) / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= params.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and always the most likely token (a top_p below float32's range would drop it too)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` (vocab,) and the `top` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), -1)
    best = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(logprobs[token]), pairs)
