"""OpenAI-compatible requests on top of a `ModelManager`: errors in OpenAI's shape, and validated request bodies
(`schemas`) turned into what the pipeline runs: messages with decoded images, or raw prompts, and the options."""
from __future__ import annotations

import base64
import binascii
import urllib.request
from dataclasses import dataclass, field

from pydantic import ValidationError

from pop_vlm import PopConfig
from pop_vlm.config import parse_prune_layers

from .limits import Limits
from .schemas import ChatCompletionRequest, CompletionRequest


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- validation errors in OpenAI's words ----------------------------------------------------------------------
KINDS = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
         "list_type": "a list", "dict_type": "an object", "model_type": "an object",
         "model_attributes_type": "an object", "none_required": "null"}


def _is_branch(item) -> bool:
    """Whether a location item names a union member (pydantic puts those in error locations) rather than a field."""
    return isinstance(item, str) and (not item[:1].islower() or "[" in item or "-" in item
                                      or item in ("str", "int", "float", "bool", "list", "dict", "none"))


def _param(loc) -> str | None:
    parts, skip_tag = [], False
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif _is_branch(item):
            skip_tag = skip_tag or "tagged-union" in item  # the discriminator's value follows the list index
        elif skip_tag:
            skip_tag = False
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(error: dict, param: str | None) -> str:
    kind, ctx, name = error["type"], error.get("ctx") or {}, f"'{param}'"
    if "message" in ctx:
        return ctx["message"]
    if kind == "json_invalid":
        return "the request body is not valid JSON"
    if kind == "missing" and param is None:
        return "the request body is missing: send a JSON object"
    if kind in KINDS:
        return "the request body must be a JSON object" if param is None else f"{name} must be {KINDS[kind]}"
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if kind == "missing":
        return f"{name} is required"
    bounds = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
              "greater_than": ("greater than", "gt"), "less_than": ("less than", "lt")}
    if kind in bounds:
        words, key = bounds[kind]
        return f"{name} must be {words} {ctx.get(key)}, got {_short(error.get('input'))}"
    if kind in ("too_short", "too_long"):
        words = "at least" if kind == "too_short" else "at most"
        limit = ctx.get("min_length", ctx.get("max_length"))
        return f"{name} must have {words} {limit} item{'s' if limit != 1 else ''}"
    if kind == "string_too_short":
        return f"{name} must not be empty"
    if kind == "literal_error":
        return f"{name} must be one of {ctx.get('expected')}, got {_short(error.get('input'))}"
    if kind == "union_tag_invalid":
        return f"'{param}.type' must be one of {ctx.get('expected_tags')}, got {ctx.get('tag')!r}"
    if kind == "union_tag_not_found":
        return f"{name} needs a 'type'"
    if error["msg"].startswith("must"):
        return f"{name} {error['msg']}"
    if param is None or param.split(".")[-1].split("[")[0] in error["msg"]:
        return error["msg"]
    return f"{name}: {error['msg']}"


def error_from_validation(errors, prefix: tuple = ()) -> APIError:
    """One 400 error for pydantic's errors, as OpenAI reports one: unknown fields first, then the most specific
    error (a wrong type on one branch of "a string or a list" says less than the other branch's error)."""
    errors = [dict(e, loc=tuple(e["loc"])[len(prefix):]) for e in errors]
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    telling = [e for e in errors if not (e["type"] in KINDS and e["loc"] and _is_branch(e["loc"][-1]))]
    if unknown:
        error = unknown[0]
    elif telling:
        error = max(telling, key=lambda e: len(e["loc"]))
    else:  # a value of none of the allowed types
        error = errors[0]
        param = _param(error["loc"])
        kinds = " or ".join(dict.fromkeys(KINDS.get(e["type"], e["type"]) for e in errors))
        return APIError(400, f"'{param}' must be {kinds}", param=param)
    param = None if error["type"] == "json_invalid" else (error.get("ctx") or {}).get("param") or _param(error["loc"])
    return APIError(400, _message(error, param), param=param)


def validate(model, body):
    """A request body (a dict) validated against a schema, or the APIError saying what is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise error_from_validation(err.errors()) from None


# ---- what the pipeline runs ---------------------------------------------------------------------------------
@dataclass
class ImageFetchPolicy:
    allow_remote: bool = False
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0


@dataclass
class GenerationRequest:
    """A validated request: what to run (chat messages, or raw prompts) and how."""

    model: str | None
    messages: list[dict] | None = None  # chat: the pipeline's messages
    prompts: list[str] | None = None  # legacy completions: raw prompts, each answered n times
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: int | None = None  # None: off; else how many alternatives per token
    mode: str = "pop"
    prune_layers: object = None
    generation: dict = field(default_factory=dict)

    @property
    def pop_config(self) -> PopConfig:
        return PopConfig(prune_layers=parse_prune_layers(self.prune_layers))

    def streams(self, pipe, time_limit_s: float | None) -> list:
        """One piece stream per prompt (a chat has one); every check runs here, before any model work."""
        options = dict(mode=self.mode, pop=self.pop_config, time_limit_s=time_limit_s, n=self.n,
                       logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0, **self.generation)
        if self.messages is not None:
            return [pipe.stream_chat(self.messages, reuse_prefix=True, **options)]
        # raw prompts are not continued from cached conversations: their answers must not depend on earlier requests
        return [pipe.stream_prompt(prompt, **options) for prompt in self.prompts]


def _sampling(body, limits: Limits, max_tokens, default_max_tokens: int, max_tokens_param: str) -> dict:
    if max_tokens is not None and max_tokens > limits.max_new_tokens:
        raise APIError(400, f"'{max_tokens_param}' must be at most {limits.max_new_tokens} on this server, got "
                            f"{max_tokens}", param=max_tokens_param)
    temperature = 1.0 if body.temperature is None else body.temperature
    greedy = temperature == 0
    return dict(do_sample=not greedy, temperature=1.0 if greedy else temperature,
                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                max_new_tokens=max_tokens or min(default_max_tokens, limits.max_new_tokens),
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                stop=[body.stop] if isinstance(body.stop, str) else body.stop, ignore_eos=bool(body.ignore_eos))


def _common(body, **fields) -> GenerationRequest:
    pop = body.pop
    return GenerationRequest(
        model=body.model, stream=bool(body.stream), n=body.n or 1, mode=pop.mode if pop else "pop",
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        prune_layers=pop.prune_layers if pop else None, **fields)


def parse_request(body, policy: ImageFetchPolicy, limits: Limits | None = None) -> GenerationRequest:
    """A chat completion request (a dict or a validated `ChatCompletionRequest`)."""
    limits = limits or Limits()
    if not isinstance(body, ChatCompletionRequest):
        body = validate(ChatCompletionRequest, body)
    which = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _common(body,
                   messages=[_convert_message(m, i, policy, limits) for i, m in enumerate(body.messages)],
                   logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                   generation=_sampling(body, limits, max_tokens, 128, which))


def parse_completion_request(body, limits: Limits | None = None) -> GenerationRequest:
    """A legacy completion request (a dict or a validated `CompletionRequest`)."""
    limits = limits or Limits()
    if not isinstance(body, CompletionRequest):
        body = validate(CompletionRequest, body)
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    for i, prompt in enumerate(prompts):
        where = "prompt" if isinstance(body.prompt, str) else f"prompt[{i}]"
        if not prompt:
            raise APIError(400, f"'{where}' is empty", param=where)
        if len(prompt) > limits.max_question_chars:
            raise APIError(400, f"'{where}' has {len(prompt)} characters; the limit is {limits.max_question_chars}",
                           param=where)
    return _common(body, prompts=prompts, logprobs=body.logprobs,
                   generation=_sampling(body, limits, body.max_tokens, 16, "max_tokens"))


def _clean_text(text: str, limits: Limits, param: str) -> str:
    if not text.strip():
        return text
    try:
        return limits.clean_question(text)
    except ValueError as err:
        raise APIError(400, str(err), param=param) from None


def _convert_message(message, index: int, policy: ImageFetchPolicy, limits: Limits) -> dict:
    """OpenAI message -> the pipeline's message (`image_url` parts become decoded image bytes)."""
    param = f"messages[{index}]"
    role = "system" if message.role == "developer" else message.role
    if isinstance(message.content, str):
        return {"role": role, "content": _clean_text(message.content, limits, f"{param}.content")}
    parts = []
    for j, part in enumerate(message.content):
        where = f"{param}.content[{j}]"
        if part.type == "text":
            parts.append({"type": "text", "text": _clean_text(part.text, limits, f"{where}.text")})
        else:
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            parts.append({"type": "image", "image": fetch_image_bytes(url, policy, where, limits.max_upload_bytes)})
    return {"role": role, "content": parts}


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
