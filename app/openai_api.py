"""OpenAI-compatible chat completions on top of a `ModelManager`: request parsing, responses, SSE chunks."""
from __future__ import annotations

import base64
import binascii
import json
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

from pop_vlm import PopConfig
from pop_vlm.config import parse_prune_layers

from .limits import Limits


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ImageFetchPolicy:
    allow_remote: bool = False
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    mode: str = "pop"
    prune_layers: object = None
    extras: dict = field(default_factory=dict)

    @property
    def sampling(self) -> dict:
        greedy = self.temperature == 0
        return dict(do_sample=not greedy, temperature=self.temperature if not greedy else 1.0, top_p=self.top_p,
                    seed=self.seed, max_new_tokens=self.max_tokens)

    @property
    def pop_config(self) -> PopConfig:
        return PopConfig(prune_layers=parse_prune_layers(self.prune_layers))


def _number(body: dict, name: str, default, low, high, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise APIError(400, f"'{name}' must be a {'integer' if kind is int else 'number'}", param=name)
    if not low <= value <= high:
        raise APIError(400, f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return kind(value)


def parse_request(body, policy: ImageFetchPolicy, limits: Limits | None = None) -> ChatRequest:
    limits = limits or Limits()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    pop = body.get("pop") or {}
    if not isinstance(pop, dict):
        raise APIError(400, "'pop' must be an object like {\"mode\": \"pop\", \"prune_layers\": 9}", param="pop")
    mode = pop.get("mode", "pop")
    if mode not in ("pop", "full", "static"):
        raise APIError(400, f"pop.mode must be pop, full or static, got {mode!r}", param="pop.mode")
    try:
        prune = parse_prune_layers(pop.get("prune_layers"))
    except ValueError as err:
        raise APIError(400, str(err), param="pop.prune_layers") from None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        model=body.get("model"),
        messages=[_convert_message(m, i, policy, limits) for i, m in enumerate(messages)],
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", min(128, limits.max_new_tokens), 1,
                           limits.max_new_tokens, int),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, int),
        stream=bool(body.get("stream", False)),
        mode=mode,
        prune_layers=prune,
    )


def _clean_text(text, limits: Limits, param: str) -> str:
    if not isinstance(text, str):
        raise APIError(400, f"{param} must be a string", param=param)
    if not text.strip():
        return text
    try:
        return limits.clean_question(text)
    except ValueError as err:
        raise APIError(400, str(err), param=param) from None


def _convert_message(message, index: int, policy: ImageFetchPolicy, limits: Limits) -> dict:
    """OpenAI message -> the pipeline's message (`image_url` parts become decoded image bytes)."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(400, f"{param} must be an object", param=param)
    role = message.get("role")
    if role not in ("system", "user", "assistant", "developer"):
        raise APIError(400, f"{param}.role must be system, user or assistant", param=f"{param}.role")
    content = message.get("content")
    if isinstance(content, str):
        return {"role": "system" if role == "developer" else role, "content": _clean_text(content, limits, f"{param}.content")}
    if not isinstance(content, list):
        raise APIError(400, f"{param}.content must be a string or a list of parts", param=f"{param}.content")
    parts = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _clean_text(part.get("text", ""), limits, f"{where}.text")})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append({"type": "image", "image": fetch_image_bytes(url, policy, where, limits.max_upload_bytes)})
        else:
            raise APIError(400, f"{where}.type must be 'text' or 'image_url'", param=where)
    return {"role": "system" if role == "developer" else role, "content": parts}


def fetch_image_bytes(url, policy: ImageFetchPolicy, param: str, max_bytes: int | None = None) -> bytes:
    max_bytes = min(max_bytes or policy.max_bytes, policy.max_bytes)
    if not isinstance(url, str) or not url:
        raise APIError(400, "image_url.url must be a data: URL", param=param)
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise APIError(400, "image data: URLs must be base64 (data:image/png;base64,...)", param=param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "the image data: URL is not valid base64", param=param) from None
        if len(data) > max_bytes:
            raise APIError(413, f"the image is larger than {max_bytes} bytes", param=param)
        return data
    if url.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise APIError(400, "remote image URLs are disabled on this server: send the image as a data: URL", param=param)
        try:
            with urllib.request.urlopen(url, timeout=policy.timeout_s) as response:  # noqa: S310 - opt-in flag
                data = response.read(max_bytes + 1)
        except Exception as err:  # noqa: BLE001
            raise APIError(400, f"cannot fetch the image: {err}", param=param) from None
        if len(data) > max_bytes:
            raise APIError(413, f"the image is larger than {max_bytes} bytes", param=param)
        return data
    raise APIError(400, "image_url.url must be a data: URL", param=param)


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def finish_reason(answer) -> str:
    """OpenAI knows "stop" and "length"; a generation cut by the request timeout reads as "length"."""
    return "stop" if answer.finish_reason == "stop" else "length"


def response_body(request_id: str, model: str, answer) -> dict:
    usage = {"prompt_tokens": answer.n_prompt_tokens, "completion_tokens": len(answer.token_ids),
             "total_tokens": answer.n_prompt_tokens + len(answer.token_ids)}
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                     "finish_reason": finish_reason(answer), "logprobs": None}],
        "usage": usage,
        "timings": answer.timings.as_dict(),
        "pop": {"mode": answer.mode, "pruned_layers": answer.pruned_layers, "n_image_tokens": answer.n_image_tokens,
                "timed_out": answer.finish_reason == "timeout"},
    }


def chunk(request_id: str, model: str, delta: dict, finish_reason=None, **extra) -> str:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
    return f"data: {json.dumps(body)}\n\n"
