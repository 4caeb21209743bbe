"""One server process: the OpenAI-style HTTP API and the Gradio page (mounted at /)."""
from __future__ import annotations

from contextlib import asynccontextmanager

import os
import socket
import threading

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from .auth import RequireAPIKey, page_login
from .models import ModelManager
from .openai_api import ImageFetchPolicy
from .openai_routes import add_openai_routes
from .ui import asset_paths, build_demo


def create_app(manager: ModelManager, *, policy: ImageFetchPolicy | None = None, queue_size: int = 16,
               load_in_background: bool = True, replica: str | None = None,
               session_cookie: tuple[str, str] | None = None, api_keys: tuple[str, ...] = (),
               ui_auth: list[tuple[str, str]] | None = None) -> FastAPI:
    """`replica` names this server in the `x-pop-vlm-replica` response header (default: host:pid); under Ray
    Serve each replica passes its own id, so clients see how requests spread. `session_cookie` (name, value), set
    on the page's responses, lets a sticky router send a browser's later requests back here (see `ray_router`).
    `api_keys`: every /v1/* request needs one as a bearer token; the page then asks for a login (`ui_auth`'s users,
    or an API key as the password)."""
    policy = policy or ImageFetchPolicy()
    api = FastAPI(title="pop-vlm", description="Vision-language models with Prefill-Only Pruning",
                  lifespan=worker_threads_for(manager))
    if api_keys:
        api.add_middleware(RequireAPIKey, keys=api_keys)  # added first: innermost, so refusals get the headers below
    api.add_middleware(AddResponseHeader, name=REPLICA_HEADER, value=replica or process_name())
    if session_cookie is not None:
        # on the page's responses only: API clients should keep spreading over replicas. Set on each response,
        # not once, so that a browser moved here after its replica died is pointed at this one.
        cookie_name, cookie_value = session_cookie
        api.add_middleware(AddResponseHeader, name="set-cookie", skip_paths=API_PATHS,
                           value=f"{cookie_name}={cookie_value}; Path=/; HttpOnly; SameSite=Lax")

    @api.get("/healthz")
    def healthz():
        if not manager.ready.is_set():
            return JSONResponse({"status": "loading", "model": manager.default}, status_code=503)
        if manager.load_error:
            return JSONResponse({"status": "error", "model": manager.default, "error": manager.load_error}, status_code=503)
        if not manager.default:
            return JSONResponse({"status": "error", "error": "no model configured"}, status_code=503)
        pipe = manager.get(manager.default)
        return {"status": "ok", "model": manager.default, "device": str(pipe.device), "layers": pipe.num_layers,
                "memory_rss_bytes": resident_memory_bytes(), **manager.load()}

    add_openai_routes(api, manager, policy)

    demo = build_demo(manager)
    demo.queue(max_size=queue_size, default_concurrency_limit=manager.limits.max_batch_size)
    login = page_login(api_keys, ui_auth or [])
    key_login = login is not None and not ui_auth
    app = gr.mount_gradio_app(api, demo, path="/", allowed_paths=asset_paths(), auth=login,
                              auth_message="Log in with any user name and an API key as the password." if key_login else None)
    # requests for the model (API and page clicks, running or waiting), unlike open connections: what to scale on
    app.state.model_requests = lambda: manager.requests_in_line + page_events_waiting(demo)
    if load_in_background:
        threading.Thread(target=manager.load_default, daemon=True, name="load-default-model").start()
    else:
        manager.load_default()
    return app


def worker_threads_for(manager: ModelManager):
    """A lifespan that sizes the worker threads to the requests the server admits: each running or queued request
    holds a thread (streams are produced in threads), and with fewer threads than that the running requests could
    not get one to send their next token while queued ones wait for a place."""
    import anyio.to_thread

    @asynccontextmanager
    async def lifespan(_app):
        needed = manager.admission.max_running + manager.admission.max_queue + 8
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, needed)
        yield

    return lifespan


def page_events_waiting(demo: gr.Blocks) -> int:
    """Page clicks waiting in Gradio's queue (not yet running, so not yet admitted by the model manager). Gradio
    offers no public count; its queue's length is it."""
    queue = getattr(demo, "_queue", None)
    try:
        return len(queue) if queue is not None else 0
    except TypeError:
        return 0


REPLICA_HEADER = "x-pop-vlm-replica"


def process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class AddResponseHeader:
    """Pure ASGI middleware (streams pass through untouched) adding one header to every HTTP response, except to
    requests whose path starts with one of `skip_paths`."""

    def __init__(self, app, name: str, value: str, skip_paths: tuple[str, ...] = ()):
        self.app, self.skip_paths = app, skip_paths
        self.header = (name.encode("latin-1"), value.encode("latin-1", "replace"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "").startswith(self.skip_paths):
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return await self.app(scope, receive, send_with_header)


API_PATHS = ("/v1/", "/healthz")


def resident_memory_bytes() -> int:
    """This process's resident memory now (Linux), for load tests that watch for leaks."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
