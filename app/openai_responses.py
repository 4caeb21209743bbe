"""OpenAI-shaped responses from the pipeline's answers: whole bodies, and server-sent event streams (chat and
legacy completions), with usage, log-probabilities and this server's `timings` / `pop` extensions."""
from __future__ import annotations

import json
import logging
import time
import uuid

from .models import Busy
from .openai_api import APIError

log = logging.getLogger(__name__)

#: JSON has no -inf: a token the model rules out reads as OpenAI's floor
LOGPROB_FLOOR = -9999.0


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(choice) -> str:
    """OpenAI knows "stop" and "length"; a generation cut by the request timeout reads as "length"."""
    return "stop" if choice.finish_reason == "stop" else "length"


def usage(answers) -> dict:
    prompt = sum(a.n_prompt_tokens for a in answers)
    completion = sum(len(c.token_ids) for a in answers for c in a.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def pop_info(answer) -> dict:
    return {"mode": answer.mode, "pruned_layers": answer.pruned_layers, "n_image_tokens": answer.n_image_tokens,
            "timed_out": any(c.finish_reason == "timeout" for c in answer.choices)}


def _floor(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


class Logprobs:
    """The pipeline's `TokenLogprob`s in OpenAI's two shapes; token ids become their text with `token_text`."""

    def __init__(self, token_text):
        self.token_text = token_text

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, logprobs) -> dict | None:
        if logprobs is None:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs],
                "refusal": None}

    def legacy(self, logprobs, offset: int = 0) -> dict | None:
        """`logprobs` of a completion: the chosen token is always among `top_logprobs`, as in OpenAI's."""
        if logprobs is None:
            return None
        tokens, offsets, tops = [], [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top = {}
            for token_id, value in [*lp.top, (lp.token_id, lp.logprob)]:
                top.setdefault(self.token_text(token_id), _floor(value))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [_floor(lp.logprob) for lp in logprobs], "top_logprobs": tops,
                "text_offset": offsets}


# ---- whole responses ------------------------------------------------------------------------------------------
def chat_body(request_id: str, model: str, answer, logprobs: Logprobs) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": finish_reason(c), "logprobs": logprobs.chat(c.logprobs)} for c in answer.choices],
        "usage": usage([answer]),
        "timings": answer.timings.as_dict(),
        "pop": pop_info(answer),
    }


def completion_body(request_id: str, model: str, answers, logprobs: Logprobs) -> dict:
    """Prompt p's choice j has index p * n + j, as in OpenAI's."""
    choices = [{"index": p * len(a.choices) + c.index, "text": c.text, "finish_reason": finish_reason(c),
                "logprobs": logprobs.legacy(c.logprobs)} for p, a in enumerate(answers) for c in a.choices]
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage(answers),
        "timings": answers[0].timings.as_dict(), "pop": pop_info(answers[0]),
    }


def run_all(manager, streams) -> list:
    """Run every stream to its `Answer`, holding the device once for all of them."""
    with manager.admitted():
        answers = []
        for pieces in streams:
            answer = None
            for answer in pieces:
                pass
            answers.append(answer)
        return answers


# ---- streams --------------------------------------------------------------------------------------------------
def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _guarded(manager, produce, streams):
    """Server-sent events from `produce()`, holding the device; failures after the headers are out become an
    error event, as OpenAI's streams report them, and the stream still ends with [DONE]. Closed early (the client
    went away), it closes the request's piece `streams` before it gives up its place: their generation stops and
    leaves the batch now, rather than whenever the garbage collector reaches them."""
    try:
        with manager.admitted():
            try:
                yield from produce()
            finally:
                for pieces in streams:
                    pieces.close()
    except Busy as err:
        yield event(APIError(429, str(err), kind="rate_limit_error", code="busy").body())
    except ValueError as err:
        yield event(APIError(400, str(err)).body())
    except Exception as err:  # noqa: BLE001 - the client gets an error event instead of a cut stream
        log.exception("generation failed mid-stream")
        yield event(APIError(500, f"generation failed: {type(err).__name__}", kind="server_error").body())
    yield "data: [DONE]\n\n"


def chat_events(manager, streams, request_id: str, model: str, n: int, include_usage: bool, logprobs: Logprobs):
    def head(choices, **extra) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": choices, **extra}

    def produce():
        (pieces,) = streams
        for index in range(n):
            yield event(head([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                               "logprobs": None}]))
        answer = None
        for piece in pieces:
            if isinstance(piece, str):
                yield event(head([{"index": piece.index, "delta": {"content": str(piece)}, "finish_reason": None,
                                   "logprobs": logprobs.chat(piece.logprobs)}]))
            else:
                answer = piece
        extensions = {"timings": answer.timings.as_dict(), "pop": pop_info(answer)}
        for choice in answer.choices:
            last = choice.index == n - 1 and not include_usage
            yield event(head([{"index": choice.index, "delta": {}, "finish_reason": finish_reason(choice),
                               "logprobs": None}], **(extensions if last else {})))
        if include_usage:
            yield event(head([], usage=usage([answer]), **extensions))

    return _guarded(manager, produce, streams)


def completion_events(manager, streams, request_id: str, model: str, n: int, include_usage: bool,
                      logprobs: Logprobs):
    def head(choices, **extra) -> dict:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, **extra}

    def produce():
        answers = []
        for p, pieces in enumerate(streams):
            offsets = {}
            for piece in pieces:
                if isinstance(piece, str):
                    offset = offsets.get(piece.index, 0)
                    offsets[piece.index] = offset + len(piece)
                    yield event(head([{"index": p * n + piece.index, "text": str(piece), "finish_reason": None,
                                       "logprobs": logprobs.legacy(piece.logprobs, offset)}]))
                else:
                    answers.append(piece)
            last_prompt = p == len(streams) - 1
            for choice in answers[-1].choices:
                last = last_prompt and choice.index == n - 1 and not include_usage
                extensions = {"timings": answers[0].timings.as_dict(), "pop": pop_info(answers[0])} if last else {}
                yield event(head([{"index": p * n + choice.index, "text": "", "finish_reason": finish_reason(choice),
                                   "logprobs": None}], **extensions))
        if include_usage:
            yield event(head([], usage=usage(answers), timings=answers[0].timings.as_dict(), pop=pop_info(answers[0])))

    return _guarded(manager, produce, streams)
