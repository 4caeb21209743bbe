"""The generation loop, in stages: prefill (pop.py), then one decode step per token.

`generate_tokens` is the one place where tokens are produced; the pipeline, the CLI, the benchmark and the
web app all go through it.
"""
from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from .config import PopConfig, check_max_new_tokens
from .families.base import FamilyAdapter, Prompt
from .pop import PrefillPlan, make_plan, prefill


@dataclass
class Timings:
    """Where the time to first token went, and how fast decoding ran. Seconds unless named otherwise."""

    preprocess_s: float = 0.0  # processor: image resize/normalise, chat template, tokenisation
    vision_s: float = 0.0  # vision encoder and merging its features into the prompt
    prefill_s: float = 0.0  # decoder prefill (POP: pruned layers + KV projections)
    first_token_s: float = 0.0  # the step that yields the first token (POP: the boundary step)
    ttft_s: float = 0.0  # request to first token: all of the above
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    peak_memory_bytes: int = 0  # CUDA: peak allocated during the request; CPU: the process's peak RSS
    n_prompt_tokens: int = 0
    n_generated_tokens: int = 0
    n_cached_tokens: int = 0  # prompt tokens whose K/V came from a cached conversation (not prefilled again)

    @property
    def prompt_tokens_per_s(self) -> float:
        busy = self.prefill_s + self.first_token_s
        return self.n_prompt_tokens / busy if busy > 0 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["prompt_tokens_per_s"] = self.prompt_tokens_per_s
        return out


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    mode: str
    pruned_layers: list[int]
    n_prompt_tokens: int
    n_image_tokens: int
    timings: Timings
    finish_reason: str = "stop"  # "stop" (an EOS token) or "length" (max_new_tokens reached)
    scores: list[torch.Tensor] | None = None  # per-step logits (vocab,), when asked for

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "mode": self.mode,
            "pruned_layers": list(self.pruned_layers),
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_image_tokens": self.n_image_tokens,
            "finish_reason": self.finish_reason,
            "timings": self.timings.as_dict(),
        }


@dataclass
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.temperature == 0.0:
            self.do_sample = False  # temperature 0 means greedy, as in OpenAI's API


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from logits of shape (vocab,)."""
    if not params.do_sample:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= params.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class StageClock:
    """Reads the time per stage, synchronising the device first so GPU work is counted where it ran.

    `timer` is the clock read: wall-clock by default; the benchmarks pass `time.thread_time` for one-thread CPU runs
    on a shared host (the thread's CPU time is immune to time-slicing by other processes).
    """

    def __init__(self, device: torch.device, timer=time.perf_counter):
        self.device = device
        self.timer = timer
        self.last = self.now()
        self.stages: dict[str, float] = {}

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.timer()

    def __call__(self, stage: str) -> None:
        now = self.now()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self.last
        self.last = now


def decode_one_token(adapter: FamilyAdapter, prompt: Prompt, cache, token_id: int, index: int, layers) -> torch.Tensor:
    """One decode step: the token at sequence index `index` through `layers`; returns its logits (1, vocab)."""
    token = torch.tensor([[token_id]], device=prompt.input_ids.device)
    hidden = adapter.embed_tokens(token)
    hidden = adapter.run_layers(hidden, adapter.decode_positions(prompt, index), cache, layers)
    return adapter.logits(hidden)[:, -1]


@dataclass
class GenerationResult:
    """Filled in by `generate_tokens` as it runs."""

    plan: PrefillPlan | None = None
    prompt: Prompt | None = None
    cache: object = None  # after the run: K/V of the prompt and of every generated token but the last
    token_ids: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] | None = None
    finish_reason: str = "length"
    timings: Timings = field(default_factory=Timings)


def generate_tokens(
    adapter: FamilyAdapter,
    inputs: dict,
    *,
    mode: str = "pop",
    pop: PopConfig | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams | None = None,
    eos_token_ids: set[int] | None = None,
    output_scores: bool = False,
    result: GenerationResult | None = None,
    auto_k: int | None = None,
    time_limit_s: float | None = None,
    cache=None,
    start: int = 0,
    prompt: Prompt | None = None,
    timer=time.perf_counter,
) -> Iterator[int]:
    """Yield generated token ids one by one; `result` collects tokens, scores, timings and the cache.

    With `time_limit_s`, decoding stops once that many seconds have passed (finish_reason "timeout"). With
    `cache` holding the K/V of the prompt's first `start` tokens, only tokens [start, N) are prefilled. With
    `prompt`, `inputs` already went through `adapter.encode` (the vision encoder): that work is not done again and
    `result.timings.vision_s` is left as the caller set it. `timer` is the clock the stages are read with.
    """
    check_max_new_tokens(max_new_tokens)
    sampling = sampling or SamplingParams()
    eos_token_ids = set(eos_token_ids or ())
    result = result if result is not None else GenerationResult()
    result.plan = plan = make_plan(adapter, mode, pop, auto_k)
    result.scores = [] if output_scores else None
    device = inputs["input_ids"].device
    generator = None
    if sampling.do_sample and sampling.seed is not None:
        generator = torch.Generator().manual_seed(int(sampling.seed))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timings = result.timings
    clock = StageClock(device, timer)
    deadline = time.monotonic() + time_limit_s if time_limit_s else None

    with torch.inference_mode():
        if prompt is None:
            prompt = adapter.encode(inputs, start=start)
            clock("vision")
            timings.vision_s = clock.stages["vision"]
        result.prompt = prompt
        cache = result.cache = cache if cache is not None else adapter.new_cache()
        logits = prefill(adapter, prompt, cache, plan, clock, full_tail=(pop or PopConfig()).full_tail, start=start)
        token = sample_token(logits[0], sampling, generator)
    clock("first_token")
    timings.n_prompt_tokens = prompt.length
    timings.prefill_s = clock.stages.get("prefill", 0.0)
    timings.first_token_s = clock.stages.get("first_token", 0.0)
    timings.ttft_s = timings.preprocess_s + timings.vision_s + timings.prefill_s + timings.first_token_s

    index = prompt.length
    while True:
        result.token_ids.append(token)
        if output_scores:
            result.scores.append(logits[0].float().cpu())
        timings.n_generated_tokens = len(result.token_ids)
        yield token
        clock.last = clock.now()  # time spent by the consumer is not decode time
        if token in eos_token_ids:
            result.finish_reason = "stop"
            break
        if len(result.token_ids) >= max_new_tokens:
            result.finish_reason = "length"
            break
        if deadline is not None and time.monotonic() > deadline:
            result.finish_reason = "timeout"
            break
        with torch.inference_mode():
            logits = decode_one_token(adapter, prompt, cache, token, index, plan.decode_layers)
            token = sample_token(logits[0], sampling, generator)
        clock("decode")
        index += 1

    timings.decode_s = clock.stages.get("decode", 0.0)
    steps = len(result.token_ids) - 1
    timings.decode_tokens_per_s = steps / timings.decode_s if timings.decode_s > 0 else 0.0
    timings.peak_memory_bytes = peak_memory_bytes(device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
