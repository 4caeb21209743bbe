"""The OpenAI-compatible routes under /v1, their errors in OpenAI's shape (validation errors as 400, unknown
paths as 404, wrong methods as 405), and the OpenAPI description of them."""
from __future__ import annotations

import logging
import os
import time

import anyio
from fastapi import FastAPI, Request
from fastapi.concurrency import iterate_in_threadpool, run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from pop_vlm import zoo

from .models import Busy, ModelError, ModelManager
from .openai_api import (APIError, GenerationRequest, ImageFetchPolicy, error_from_validation,
                         parse_completion_request, parse_request)
from .openai_responses import (Logprobs, chat_body, chat_events, completion_body, completion_events, completion_id,
                               run_all)
from .schemas import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse, ModelCard,
                      ModelList)

API_PREFIX = "/v1/"
log = logging.getLogger(__name__)


def errors(*statuses: int) -> dict:
    words = {400: "invalid request", 404: "unknown model", 405: "method not allowed", 413: "image too large",
             429: "busy", 500: "generation failed", 503: "the model is loading"}
    return {status: {"model": ErrorResponse, "description": words[status]} for status in statuses}


def streamed(chunk_model) -> dict:
    """The 200 response: JSON, or with `stream: true` server-sent events (OpenAPI 3.1: the schema is one event's)."""
    data = {"anyOf": [
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": f"#/components/schemas/{chunk_model.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}},
        {"const": "[DONE]"}],
        "description": f"a {chunk_model.__name__} as JSON, the last event [DONE]; a failure after the stream has begun "
                       "is sent as an ErrorResponse before [DONE]"}
    return {200: {"content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}}}}}


class EventStream(StreamingResponse):
    """Server-sent events from a generator that runs in the thread pool. However the response ends, the generator is
    closed then: a stream cut short (the client went away) would otherwise keep the request's place in the
    admission, and its batch row, until the garbage collector breaks the reference cycle the cancellation leaves."""

    def __init__(self, events):
        super().__init__(iterate_in_threadpool(events), media_type="text/event-stream")
        self.events = events

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # the response's task may be cancelled: closing must still run
                await run_in_threadpool(self.events.close)


def add_openai_routes(api: FastAPI, manager: ModelManager, policy: ImageFetchPolicy) -> None:
    started = int(time.time())

    @api.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @api.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        """A bug must still answer in the API's shape (the traceback goes to the log, not to the client)."""
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=err)
        error = APIError(500, f"internal error ({type(err).__name__}); the server log has the details",
                         kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @api.exception_handler(RequestValidationError)
    async def invalid_request(_, err: RequestValidationError):
        error = error_from_validation(err.errors(), prefix=("body",))
        return JSONResponse(error.body(), status_code=error.status)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        if not request.url.path.startswith(API_PREFIX):
            return JSONResponse({"detail": err.detail}, status_code=err.status_code, headers=err.headers)
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code,
                            headers=err.headers)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": model_created(name, started), "owned_by": "pop-vlm"}

    @api.get("/v1/models", response_model=ModelList)
    def models():
        return {"object": "list", "data": [model_card(name) for name in manager.choices()]}

    @api.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(404))
    def model(model_id: str):
        if model_id not in manager.choices():
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card(model_id)

    @api.post("/v1/chat/completions", response_model=ChatCompletion,
              responses={**streamed(ChatCompletionChunk), **errors(400, 404, 413, 429, 500, 503)})
    async def chat_completions(body: ChatCompletionRequest):
        """OpenAI's chat completions, with `image_url` parts as data: URLs and the `pop` extension."""
        served_model(manager, body.model)  # before any image is decoded or fetched, and before any loading
        request = parse_request(body, policy, manager.limits)
        pipe, model_name, streams = await start(manager, request, default_param="messages")
        logprobs, request_id = Logprobs(pipe.token_text), completion_id("chatcmpl")
        if request.stream:
            events = chat_events(manager, streams, request_id, model_name, request.n, request.include_usage, logprobs)
            return EventStream(events)
        (answer,) = await run(manager, streams)
        return chat_body(request_id, model_name, answer, logprobs)

    @api.post("/v1/completions", response_model=Completion,
              responses={**streamed(Completion), **errors(400, 404, 429, 500, 503)})
    async def completions(body: CompletionRequest):
        """OpenAI's legacy completions: raw prompts, no chat template, and the `pop` extension."""
        served_model(manager, body.model)
        request = parse_completion_request(body, manager.limits)
        pipe, model_name, streams = await start(manager, request, default_param="prompt")
        logprobs, request_id = Logprobs(pipe.token_text), completion_id("cmpl")
        if request.stream:
            events = completion_events(manager, streams, request_id, model_name, request.n, request.include_usage,
                                       logprobs)
            return EventStream(events)
        return completion_body(request_id, model_name, await run(manager, streams), logprobs)

    @api.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    async def no_such_route(request: Request, path: str):
        allowed = sorted({method for route in api.routes if isinstance(route, APIRoute) and route.include_in_schema
                          and route.path_regex.match(request.url.path) for method in route.methods})
        if allowed:
            raise APIError(405, f"{request.method} is not allowed on {request.url.path}: use {', '.join(allowed)}",
                           code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
        raise APIError(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found")

    api.openapi = lambda: describe(api, manager)


def served_model(manager: ModelManager, name) -> str:
    """The request's model if the operator serves it; 404 model_not_found otherwise, decided from the name alone."""
    if name is not None and not isinstance(name, str):
        raise APIError(400, "'model' must be a string", param="model")
    try:
        return manager.check_name(name)
    except ModelError as err:
        raise APIError(404, str(err), param="model", code="model_not_found") from None


async def start(manager: ModelManager, request: GenerationRequest, default_param: str):
    """The pipeline, the model's name and the request's piece streams; every check is done by then."""
    if not manager.ready.is_set():
        raise APIError(503, "the model is still loading; retry shortly", kind="server_error", code="loading")
    try:
        pipe = await run_in_threadpool(manager.get, request.model)
    except ModelError as err:
        raise APIError(404, str(err), param="model", code="model_not_found") from None
    try:
        streams = await run_in_threadpool(request.streams, pipe, manager.limits.request_timeout_s)
    except (ValueError, TypeError) as err:
        raise APIError(400, str(err), param=param_for(str(err), default_param)) from None
    return pipe, request.model or manager.default, streams


async def run(manager: ModelManager, streams) -> list:
    try:
        return await run_in_threadpool(run_all, manager, streams)
    except Busy as err:
        raise APIError(429, str(err), kind="rate_limit_error", code="busy") from None
    except ValueError as err:
        raise APIError(400, str(err)) from None


def param_for(message: str, default: str) -> str:
    """The request field a pipeline's error is about."""
    if "prune" in message or "deepstack" in message:
        return "pop.prune_layers"
    if "max_new_tokens" in message:
        return "max_tokens"
    return default


def model_created(name: str, default: int) -> int:
    """When a model's files were written (its config), for local and bundled models; else the server's start."""
    folder = name if os.path.isdir(name) else zoo.bundled_path(name) if name in zoo.BUNDLED else None
    try:
        return int(os.path.getmtime(os.path.join(folder, "config.json"))) if folder else default
    except OSError:
        return default


def describe(api: FastAPI, manager: ModelManager) -> dict:
    """FastAPI's OpenAPI document, less its 422 responses (validation errors are answered 400 in OpenAI's shape)
    and with this server's token cap as the maximum of max_tokens."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        chunk = ChatCompletionChunk.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(chunk.pop("$defs", {}))
        components["ChatCompletionChunk"] = chunk
        components.setdefault("ErrorResponse", ErrorResponse.model_json_schema(
            ref_template="#/components/schemas/{model}"))
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            for field in ("max_tokens", "max_completion_tokens"):
                spec = components.get(name, {}).get("properties", {}).get(field)
                for option in (spec or {}).get("anyOf", []):
                    if option.get("type") == "integer":
                        option["maximum"] = manager.limits.max_new_tokens
        api.openapi_schema = schema
    return api.openapi_schema
