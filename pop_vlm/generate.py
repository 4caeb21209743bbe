"""The generation loop, in stages: the prefill (pop.py) once, then one decode step per token of each choice.

`generate_choices` (and `generate_tokens`, its one-choice form) is the one place where tokens are produced; the
pipeline, the CLI, the benchmarks and the web app all go through it.
"""
from __future__ import annotations

import copy
import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .config import PopConfig, check_max_new_tokens
from .families.base import FamilyAdapter, Prompt
from .pop import PrefillPlan, make_plan, prefill
from .results import Timings, TokenLogprob
from .sampling import SamplingParams, sample_token, token_logprob
from .textstream import DecodedText


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
class ChoiceResult:
    """One choice's tokens as `generate_choices` produces them."""

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] | None = None
    logprobs: list[TokenLogprob] | None = None  # of every generated token, when asked for
    finish_reason: str = "length"
    text: DecodedText | None = None  # when the loop decodes (stop strings)


@dataclass
class GenerationResult:
    """Filled in by `generate_tokens` / `generate_choices` as they run. `token_ids`, `scores` and
    `finish_reason` are those of the first choice (the only one unless n > 1)."""

    plan: PrefillPlan | None = None
    prompt: Prompt | None = None
    cache: object = None  # after the run: K/V of the prompt and of every token but the last of the last choice
    choices: list[ChoiceResult] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def scores(self) -> list[torch.Tensor] | None:
        return self.choices[0].scores if self.choices else None

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason if self.choices else "length"


def generate_tokens(adapter: FamilyAdapter, inputs: dict, *, result: GenerationResult | None = None,
                    **options) -> Iterator[int]:
    """Yield one choice's generated token ids one by one (see `generate_choices` for the options)."""
    for _, token in generate_choices(adapter, inputs, n=1, result=result, **options):
        yield token


def generate_choices(
    adapter: FamilyAdapter,
    inputs: dict,
    *,
    n: int = 1,
    mode: str = "pop",
    pop: PopConfig | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams | None = None,
    eos_token_ids: set[int] | None = None,
    output_scores: bool = False,
    top_logprobs: int | None = None,
    stop=None,
    decode: Callable[[list[int]], str] | None = None,
    result: GenerationResult | None = None,
    auto_k: int | None = None,
    time_limit_s: float | None = None,
    cache=None,
    start: int = 0,
    prompt: Prompt | None = None,
    timer=time.perf_counter,
    batch=None,
) -> Iterator[tuple[int, int]]:
    """Prefill the prompt once, then decode `n` choices from it one after the other; yield (choice, token id).

    Each choice continues a copy of the prefilled cache (the last one the cache itself) and draws its first token
    from the same first-token logits, so the prompt's prefill — the work POP cuts — is paid once. `result`
    collects tokens, scores, log-probabilities, timings and the cache. `top_logprobs` (None: off) keeps each
    token's log-probability and that many most likely alternatives, from the logits the mode produced for that
    step (POP's first token: the boundary step's full-model logits). `stop` strings end a choice once its text —
    `decode(token_ids)` — contains one. With `time_limit_s`, decoding stops once that many seconds have passed
    (finish_reason "timeout"). With `cache` holding the K/V of the prompt's first `start` tokens, only tokens
    [start, N) are prefilled. With `prompt`, `inputs` already went through `adapter.encode` (the vision encoder):
    that work is not done again and `result.timings.vision_s` is left as the caller set it. `timer` is the clock the
    stages are read with. With `batch` (a `pop_vlm.batch.BatchScheduler`), the prefill waits for its turn on the
    device and the decode steps run batched with other requests' (the tokens are those of the run alone).
    """
    check_options(max_new_tokens, n, top_logprobs, stop, decode)
    sampling = sampling or SamplingParams()
    result = result if result is not None else GenerationResult()
    result.plan = plan = make_plan(adapter, mode, pop, auto_k)
    device = inputs["input_ids"].device
    generator = None
    if sampling.do_sample and sampling.seed is not None:
        generator = torch.Generator().manual_seed(int(sampling.seed))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = DecodeRun(adapter, plan, sampling, generator, StageClock(device, timer), set(eos_token_ids or ()),
                    max_new_tokens, time.monotonic() + time_limit_s if time_limit_s else None, batch)

    # ---- stage 1: the prefill, once for all choices
    prefilled = cache if cache is not None else adapter.new_cache()
    first_logits, first_token = prefill_once(run, inputs, prefilled, result, (pop or PopConfig()).full_tail, start,
                                             prompt)

    # ---- stage 2: each choice decodes on its own copy of the prefilled cache
    result.choices = [ChoiceResult(index=i, scores=[] if output_scores else None,
                                   logprobs=[] if top_logprobs is not None else None,
                                   text=DecodedText(decode, stop) if decode is not None else None) for i in range(n)]
    for choice in result.choices:
        with torch.inference_mode():
            # a batch row copies the cache into its slot, leaving the prefilled one as it was
            shared = choice.index == n - 1 or run.batch is not None
            result.cache = prefilled if shared else copy_cache(prefilled)
        # the first choice's first token was drawn before the first-token clock stopped
        token = first_token if choice.index == 0 else sample_token(first_logits[0], sampling, generator)
        yield from decode_choice(run, result, choice, first_logits, token, top_logprobs)
        if choice.finish_reason == "timeout":
            for rest in result.choices[choice.index + 1:]:
                rest.finish_reason = "timeout"
            break

    timings = result.timings
    timings.decode_s = run.clock.stages.get("decode", 0.0)
    steps = sum(max(len(c.token_ids) - 1, 0) for c in result.choices)
    timings.decode_tokens_per_s = steps / timings.decode_s if timings.decode_s > 0 else 0.0
    timings.peak_memory_bytes = peak_memory_bytes(device)


def check_options(max_new_tokens, n, top_logprobs, stop, decode) -> None:
    check_max_new_tokens(max_new_tokens)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or top_logprobs < 0):
        raise ValueError(f"top_logprobs must be a non-negative integer, got {top_logprobs!r}")
    if stop and decode is None:
        raise ValueError("stop strings need a decode function")


@dataclass
class DecodeRun:
    """What every stage of one request's generation shares."""

    adapter: FamilyAdapter
    plan: PrefillPlan
    sampling: SamplingParams
    generator: torch.Generator | None
    clock: StageClock
    eos_token_ids: set[int]
    max_new_tokens: int
    deadline: float | None  # time.monotonic() after which decoding stops
    batch: object = None  # a BatchScheduler: decode steps run batched with other requests'

    def device_turn(self):
        return self.batch.device_turn() if self.batch is not None else nullcontext()

    def open_row(self, prompt: Prompt, cache):
        """Where this choice's decode steps run: batched with other requests', or one at a time here."""
        if self.batch is not None:
            return self.batch.open_row(prompt, cache, self.plan.decode_layers, prompt.length + self.max_new_tokens)
        return AloneRow(self.adapter, prompt, cache, self.plan.decode_layers)


class AloneRow:
    """A sequence decoded on its own: each step is `decode_one_token` on its cache."""

    def __init__(self, adapter: FamilyAdapter, prompt: Prompt, cache, layer_ids):
        self.adapter, self.prompt, self.cache, self.layer_ids = adapter, prompt, cache, layer_ids

    def step(self, token: int, index: int) -> torch.Tensor:
        return decode_one_token(self.adapter, self.prompt, self.cache, token, index, self.layer_ids)

    def close(self):
        return self.cache


def prefill_once(run: DecodeRun, inputs: dict, cache, result: GenerationResult, full_tail, start: int,
                 prompt: Prompt | None) -> tuple[torch.Tensor, int]:
    """Encode the prompt (unless given), prefill it into `cache` (tokens [start, N)) and draw the first token;
    fills `result.prompt` and the TTFT timings. Returns (first-token logits, first token)."""
    clock, timings = run.clock, result.timings
    with run.device_turn(), torch.inference_mode():
        if run.batch is not None:
            clock("wait")  # other requests' decode steps, under load: part of the TTFT, not of the prefill
            timings.wait_s = clock.stages["wait"]
        if prompt is None:
            prompt = run.adapter.encode(inputs, start=start)
            clock("vision")
            timings.vision_s = clock.stages["vision"]
        result.prompt = prompt
        logits = prefill(run.adapter, prompt, cache, run.plan, clock, full_tail=full_tail, start=start)
        token = sample_token(logits[0], run.sampling, run.generator)
    clock("first_token")
    timings.n_prompt_tokens = prompt.length
    timings.prefill_s = clock.stages.get("prefill", 0.0)
    timings.first_token_s = clock.stages.get("first_token", 0.0)
    timings.ttft_s = (timings.preprocess_s + timings.wait_s + timings.vision_s + timings.prefill_s
                      + timings.first_token_s)
    return logits, token


def decode_choice(run: DecodeRun, result: GenerationResult, choice: ChoiceResult, logits: torch.Tensor, token: int,
                  top_logprobs: int | None) -> Iterator[tuple[int, int]]:
    """Decode one choice on `result.cache` from its first token; yield (choice index, token id) as they come."""
    counts = torch.zeros(logits.shape[-1], dtype=torch.int32) if run.sampling.penalised else None
    index = result.prompt.length
    row = None  # where the decode steps run; opened at the first one: a one-token answer never joins a batch
    try:
        while True:
            choice.token_ids.append(token)
            if counts is not None:
                counts[token] += 1
            if choice.scores is not None:
                choice.scores.append(logits[0].float().cpu())
            if top_logprobs is not None:
                choice.logprobs.append(token_logprob(logits[0], token, top_logprobs))
            stopped = choice.text.add(choice.token_ids) if choice.text is not None else False
            result.timings.n_generated_tokens = sum(len(c.token_ids) for c in result.choices)
            yield choice.index, token
            run.clock.last = run.clock.now()  # time spent by the consumer is not decode time
            if stopped or token in run.eos_token_ids:
                choice.finish_reason = "stop"
                return
            if len(choice.token_ids) >= run.max_new_tokens:
                choice.finish_reason = "length"
                return
            if run.deadline is not None and time.monotonic() > run.deadline:
                choice.finish_reason = "timeout"
                return
            with torch.inference_mode():
                if row is None:
                    row = run.open_row(result.prompt, result.cache)
                logits = row.step(token, index)
                token = sample_token(logits[0], run.sampling, run.generator, counts)
            run.clock("decode")
            index += 1
    finally:
        if row is not None:  # also when the consumer stops early (a client that went away): the row leaves
            result.cache = row.close()


def copy_cache(cache):
    """An independent copy of a KV cache (views into a preallocated buffer stay views into the copy's buffer)."""
    return copy.deepcopy(cache)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
