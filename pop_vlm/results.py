"""What a request returns: the `Answer` (with its `n` `Choice`s and their `TokenLogprob`s) and its `Timings`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Timings:
    """Where the time to first token went, and how fast decoding ran. Seconds unless named otherwise."""

    preprocess_s: float = 0.0  # processor: image resize/normalise, chat template, tokenisation
    vision_s: float = 0.0  # vision encoder and merging its features into the prompt
    prefill_s: float = 0.0  # decoder prefill (POP: pruned layers + KV projections)
    first_token_s: float = 0.0  # the step that yields the first token (POP: the boundary step)
    wait_s: float = 0.0  # waiting for the device while other requests' decode steps ran (serving under load)
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
