"""The generation loop, in stages: prefill (pop.py), then one decode step per token.

`generate_tokens` is the one place where tokens are produced; the pipeline, the CLI, the benchmark and the
web app all go through it.
"""
from __future__ import annotations

import copy
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch

from .config import PopConfig, check_max_new_tokens
from .families.base import FamilyAdapter, Prompt
from .pop import PrefillPlan, make_plan, prefill
from .textstream import DecodedText


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
class TokenLogprob:
    """A generated token's log-probability under the distribution of the step that produced it (the logits as
    the model gave them: before penalties, temperature and top-p), and the step's most likely tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


@dataclass
class Choice:
    """One of a request's `n` answers: each its own sample, continuing the same prefilled prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens) or "timeout"
    logprobs: list[TokenLogprob] | None = None  # of the tokens of `text` (the last may reach into a stop string)
    scores: list[torch.Tensor] | None = None

    def as_dict(self) -> dict:
        out = {"index": self.index, "text": self.text, "token_ids": list(self.token_ids),
               "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            out["logprobs"] = [asdict(lp) for lp in self.logprobs]
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
    finish_reason: str = "stop"  # "stop" (an EOS token or a stop string) or "length" (max_new_tokens reached)
    scores: list[torch.Tensor] | None = None  # per-step logits (vocab,), when asked for
    logprobs: list[TokenLogprob] | None = None  # when asked for (see `TokenLogprob`)
    choices: list[Choice] = field(default_factory=list)  # all n choices; the fields above are the first one's

    def as_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "mode": self.mode,
            "pruned_layers": list(self.pruned_layers),
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_image_tokens": self.n_image_tokens,
            "finish_reason": self.finish_reason,
            "timings": self.timings.as_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [asdict(lp) for lp in self.logprobs]
        if len(self.choices) > 1:
            out["choices"] = [choice.as_dict() for choice in self.choices]
        return out


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


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits` (vocab,) and the `top` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), -1)
    best = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(logprobs[token]), pairs)


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
    stages are read with.
    """
    check_max_new_tokens(max_new_tokens)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or top_logprobs < 0):
        raise ValueError(f"top_logprobs must be a non-negative integer, got {top_logprobs!r}")
    if stop and decode is None:
        raise ValueError("stop strings need a decode function")
    sampling = sampling or SamplingParams()
    eos_token_ids = set(eos_token_ids or ())
    result = result if result is not None else GenerationResult()
    result.plan = plan = make_plan(adapter, mode, pop, auto_k)
    device = inputs["input_ids"].device
    generator = None
    if sampling.do_sample and sampling.seed is not None:
        generator = torch.Generator().manual_seed(int(sampling.seed))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timings = result.timings
    clock = StageClock(device, timer)
    deadline = time.monotonic() + time_limit_s if time_limit_s else None

    # ---- stage 1: the prefill, once for all choices
    with torch.inference_mode():
        if prompt is None:
            prompt = adapter.encode(inputs, start=start)
            clock("vision")
            timings.vision_s = clock.stages["vision"]
        result.prompt = prompt
        prefilled = cache if cache is not None else adapter.new_cache()
        first_logits = prefill(adapter, prompt, prefilled, plan, clock, full_tail=(pop or PopConfig()).full_tail,
                               start=start)
        first_token = sample_token(first_logits[0], sampling, generator)
    clock("first_token")
    timings.n_prompt_tokens = prompt.length
    timings.prefill_s = clock.stages.get("prefill", 0.0)
    timings.first_token_s = clock.stages.get("first_token", 0.0)
    timings.ttft_s = timings.preprocess_s + timings.vision_s + timings.prefill_s + timings.first_token_s

    # ---- stage 2: each choice decodes on its own copy of the prefilled cache
    result.choices = [ChoiceResult(index=i, scores=[] if output_scores else None,
                                   logprobs=[] if top_logprobs is not None else None,
                                   text=DecodedText(decode, stop) if decode is not None else None) for i in range(n)]
    for choice in result.choices:
        last = choice.index == n - 1
        with torch.inference_mode():
            cache = prefilled if last else copy_cache(prefilled)
        result.cache = cache
        counts = torch.zeros(first_logits.shape[-1], dtype=torch.int32) if sampling.penalised else None
        logits, token = first_logits, first_token
        if choice.index > 0:  # the first choice's first token was drawn before the first-token clock stopped
            token = sample_token(logits[0], sampling, generator)
        index = prompt.length
        while True:
            choice.token_ids.append(token)
            if counts is not None:
                counts[token] += 1
            if output_scores:
                choice.scores.append(logits[0].float().cpu())
            if top_logprobs is not None:
                choice.logprobs.append(token_logprob(logits[0], token, top_logprobs))
            stopped = choice.text.add(choice.token_ids) if choice.text is not None else False
            timings.n_generated_tokens = sum(len(c.token_ids) for c in result.choices)
            yield choice.index, token
            clock.last = clock.now()  # time spent by the consumer is not decode time
            if stopped or token in eos_token_ids:
                choice.finish_reason = "stop"
                break
            if len(choice.token_ids) >= max_new_tokens:
                choice.finish_reason = "length"
                break
            if deadline is not None and time.monotonic() > deadline:
                choice.finish_reason = "timeout"
                break
            with torch.inference_mode():
                logits = decode_one_token(adapter, prompt, cache, token, index, plan.decode_layers)
                token = sample_token(logits[0], sampling, generator, counts)
            clock("decode")
            index += 1
        if choice.finish_reason == "timeout":
            for rest in result.choices[choice.index + 1:]:
                rest.finish_reason = "timeout"
            break

    timings.decode_s = clock.stages.get("decode", 0.0)
    steps = sum(max(len(c.token_ids) - 1, 0) for c in result.choices)
    timings.decode_tokens_per_s = steps / timings.decode_s if timings.decode_s > 0 else 0.0
    timings.peak_memory_bytes = peak_memory_bytes(device)


def copy_cache(cache):
    """An independent copy of a KV cache (views into a preallocated buffer stay views into the copy's buffer)."""
    return copy.deepcopy(cache)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
