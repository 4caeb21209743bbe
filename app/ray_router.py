"""Ray Serve request router that keeps a browser on the replica serving its page.

The Gradio page is stateful per browser: the upload, the queue entry (`/gradio_api/queue/join`) and the event stream
(`/gradio_api/queue/data`) of one click must reach the same process, or the stream waits for an event that another
replica holds. Every replica therefore names itself in a session cookie on the page's responses (see
`server.create_app`), and this router sends each request carrying that cookie back to the replica it names, while
it is alive. Requests without the cookie (the OpenAI-style API, first page loads) get Serve's usual "power of two
choices" between the least busy of two random replicas. When the named replica is gone the request goes to another
one, whose response re-points the cookie; the browser's in-flight event is lost with the replica, the next one works.

Serve pickles this class by value into every HTTP proxy, so the module depends on the standard library and Ray only.
"""
from __future__ import annotations

import pickle
import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

SESSION_COOKIE = "pop_vlm_replica"


def cookie_value(headers: list[tuple[bytes, bytes]], name: str) -> str | None:
    """The value of cookie `name` in ASGI headers, or None. Tolerates malformed cookies from other apps on the host."""
    for key, raw in headers:
        if key.lower() != b"cookie":
            continue
        for part in raw.decode("latin-1").split(";"):
            cookie_name, sep, value = part.strip().partition("=")
            if sep and cookie_name == name:
                return value.strip().strip('"') or None
    return None


def http_scope(pending_request: PendingRequest | None) -> dict[str, Any] | None:
    """The ASGI scope of a request that came through Serve's HTTP proxy (the proxy sends a pickled
    `StreamingHTTPRequest` as the only argument); None for handle calls and anything else."""
    if pending_request is None or len(pending_request.args) != 1 or not isinstance(pending_request.args[0], bytes):
        return None
    try:
        request = pickle.loads(pending_request.args[0])
    except Exception:  # noqa: BLE001 - not an HTTP request: route it without affinity
        return None
    scope = getattr(request, "asgi_scope", None)
    return scope if isinstance(scope, dict) else None


class BrowserSessionRouter(RequestRouter):
    """Sticky for requests carrying the `pop_vlm_replica` cookie; power of two choices for the rest."""

    def initialize_state(self, cookie: str = SESSION_COOKIE, **_: Any) -> None:
        self.cookie = cookie

    def sticky_replica(self, candidates: list[RunningReplica],
                       pending_request: PendingRequest | None) -> RunningReplica | None:
        scope = http_scope(pending_request)
        if scope is None:
            return None
        wanted = cookie_value(scope.get("headers", []), getattr(self, "cookie", SESSION_COOKIE))
        if wanted is None:
            return None
        return next((replica for replica in candidates if replica.replica_id.unique_id == wanted), None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # back off between rounds when every chosen replica is full, instead of spinning
            pending_request.routing_context.should_backoff = True
        sticky = self.sticky_replica(candidate_replicas, pending_request)
        if sticky is not None:
            # strict: a busy home replica makes the request wait, since another replica could not serve it
            return [[sticky]]
        # the base class asks both for their queue length and takes the shorter one that accepts
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
