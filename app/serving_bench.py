"""Serving benchmark, measured at the client: C streaming clients against a server on loopback, each sending its
requests back to back; requests per second, generated tokens per second, time to first token and inter-token
latency, and how many rows the server decoded per batched step.

Every request streams (`stream: true`, `stream_options.include_usage`), is greedy (temperature 0) and decodes
exactly `max_tokens` tokens (`ignore_eos`), so every answer has the same length whatever the model says. Request i
of a run always carries the same prompt (`Workload.body`), so the answers of a batched server can be checked
against a serial server's, prompt by prompt. A run is bounded twice: each client sends at most `per_client`
requests, and none after `seconds`; at that moment the requests the server has not admitted yet (no first event:
they wait in its queue) are cancelled, and those it admitted run to their end. The time to first token of a
cancelled request counts as the time it had waited, a lower bound, and the report says so.
"""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field

import httpx

from .loadtest import require_loopback


@dataclass
class Record:
    """One request as the client saw it (times from `time.perf_counter`)."""

    index: int
    sent: float = 0.0
    admitted: float | None = None  # the stream's first event: the server took the request
    content: list[float] = field(default_factory=list)  # arrival of each chunk with text
    done: float | None = None  # the chunk with the finish reason
    tokens: int = 0  # completion tokens, from the usage chunk
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    refused: bool = False  # HTTP 429 / 503
    lost: bool = False  # no HTTP response, or the connection dropped mid-stream
    cancelled: bool = False  # not admitted within the time bound
    cancelled_at: float | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and not self.cancelled and self.done is not None

    @property
    def ttft(self) -> float | None:
        return self.content[0] - self.sent if self.content else None

    def gaps(self) -> list[float]:
        """Inter-token latencies: the gaps between text chunks when each chunk is one token; otherwise (tokens
        without text, such as special tokens, or characters split over tokens) the mean gap, once per token."""
        if not self.content or self.tokens < 2:
            return []
        if len(self.content) == self.tokens:
            return [b - a for a, b in zip(self.content, self.content[1:])]
        return [(self.done - self.content[0]) / (self.tokens - 1)] * (self.tokens - 1)


async def _stream_one(http: httpx.AsyncClient, url: str, body: bytes, record: Record, admitted: asyncio.Event):
    """Send one streaming chat request and fill `record` as its events arrive."""
    async with http.stream("POST", url, content=body, headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            record.refused = response.status_code in (429, 503)
            record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            if record.admitted is None:
                record.admitted = now
                admitted.set()
            if "error" in event:
                record.error = event["error"].get("message", "error event")
                continue
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content") or choice.get("text") or ""
                if text:
                    record.content.append(now)
                    record.text += text
                if choice.get("finish_reason"):
                    record.done, record.finish_reason = now, choice["finish_reason"]
            if event.get("usage"):
                record.tokens = int(event["usage"]["completion_tokens"])
    if record.error is None and record.done is None:
        record.error = "the stream ended without a finish reason"


async def _request(http, url: str, body: bytes, record: Record, cancel_at: float | None) -> None:
    """One request; cancelled at `cancel_at` (perf_counter) if the server has not admitted it by then."""
    admitted = asyncio.Event()
    record.sent = time.perf_counter()
    task = asyncio.ensure_future(_stream_one(http, url, body, record, admitted))
    waiter = asyncio.ensure_future(admitted.wait())
    timeout = None if cancel_at is None else max(0.0, cancel_at - time.perf_counter())
    done, _ = await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not done:  # still in the server's queue at the time bound
        record.cancelled, record.cancelled_at = True, time.perf_counter()
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except httpx.HTTPError as err:  # a dropped connection: counted, not raised
        record.error, record.lost = f"lost: {type(err).__name__}: {err}", True
    except ValueError as err:  # an event that is not JSON
        record.error = f"{type(err).__name__}: {err}"


async def _clients(url: str, bodies: list[bytes], clients: int, seconds: float | None, timeout_s: float):
    records: list[Record] = []
    deadline = None if seconds is None else time.perf_counter() + seconds
    budget = len(bodies)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)

    async def client(http):
        while len(records) < budget and (deadline is None or time.perf_counter() < deadline):
            record = Record(index=len(records))
            records.append(record)
            await _request(http, url, bodies[record.index], record, deadline)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return records


def run_clients(url: str, bodies, clients: int, per_client: int = 2, seconds: float | None = None,
                timeout_s: float = 600.0, path: str = "/v1/chat/completions") -> tuple[list[Record], float]:
    """`clients` concurrent streaming clients; `bodies(i)` is request i's JSON body (bytes). Returns the records
    and the wall time from the first request to the last answer."""
    require_loopback(url)
    if not (1 <= clients <= 256 and 1 <= per_client <= 10_000):
        raise ValueError("clients must be 1..256 and per_client 1..10000")
    prepared = [bodies(i) for i in range(clients * per_client)]  # before the clock starts: images take time
    start = time.perf_counter()
    records = asyncio.run(_clients(url.rstrip("/") + path, prepared, clients, seconds, timeout_s))
    ends = [r.done for r in records if r.done is not None] or [time.perf_counter()]
    return records, max(ends) - start


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, nearest rank (as the load test's), NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(records: list[Record], wall_s: float, max_tokens: int) -> dict:
    """Client-side figures of one run."""
    completed = [r for r in records if r.completed]
    cancelled = [r for r in records if r.cancelled]
    # a cancelled request's TTFT is at least the time it waited: counted as that, so percentiles are lower bounds
    ttfts = [r.ttft for r in completed if r.ttft is not None] + [r.cancelled_at - r.sent for r in cancelled]
    gaps = [g for r in completed for g in r.gaps()]
    per_token = [(r.done - r.content[0]) / (r.tokens - 1) for r in completed if r.content and r.tokens > 1]
    tokens = sum(r.tokens for r in completed)
    figures = {
        "sent": len(records), "completed": len(completed), "cancelled": len(cancelled),
        "failed": sum(1 for r in records if r.error is not None and not (r.refused or r.lost)),
        "lost": sum(1 for r in records if r.lost),
        "refused": sum(1 for r in records if r.refused),
        "wrong_length": sum(1 for r in completed if r.tokens != max_tokens or r.finish_reason != "length"),
        "chunk_per_token": sum(1 for r in completed if len(r.content) == r.tokens),
        "wall_s": wall_s, "requests_per_s": len(completed) / wall_s if wall_s > 0 else 0.0,
        "tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99), "ttft_lower_bound": bool(cancelled),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
        "tpot_mean_s": statistics.fmean(per_token) if per_token else float("nan"),
        "first_errors": [r.error for r in records if r.error][:3],
    }
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in figures.items()}  # JSON has no NaN

