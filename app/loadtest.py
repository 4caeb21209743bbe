"""A bounded load test on loopback only: N API clients (and optionally P web-page sessions) for T seconds, nothing
may be lost.

Outcomes per API request: answered (200), refused (429/503: the server said it is busy), failed (any other status,
or a 200 without an answer), lost (no HTTP response at all: connection dropped, reset or timed out). A page session
is a Gradio client with its own cookies, as a browser tab, clicking "compare" (full and POP) over and over; each
click is answered or failed. Answers are counted per replica (the `x-pop-vlm-replica` header for the API, the
`pop_vlm_replica` cookie for pages), which shows the spread behind Ray Serve.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx


def require_loopback(url: str) -> None:
    """Refuse any target that is not this machine."""
    host = urlparse(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise ValueError(f"cannot resolve {host!r}") from None
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"the load test only targets loopback addresses (127.0.0.0/8, ::1); {host!r} is not one")


@dataclass
class LoadReport:
    clients: int
    seconds: float
    sent: int = 0
    answered: int = 0
    refused: int = 0
    failed: int = 0
    lost: int = 0
    latencies_s: list[float] = field(default_factory=list, repr=False)
    errors: list[str] = field(default_factory=list, repr=False)
    memory_before_bytes: int = 0
    memory_after_bytes: int = 0
    pages: int = 0
    page_clicks_answered: int = 0
    page_clicks_failed: int = 0
    api_answers_per_replica: dict[str, int] = field(default_factory=dict)
    page_clicks_per_replica: dict[str, int] = field(default_factory=dict)

    def percentile(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("latencies_s", "errors")}
        out.update({f"p{q}_s": self.percentile(q) for q in (50, 90, 99)})
        out["mean_s"] = statistics.fmean(self.latencies_s) if self.latencies_s else float("nan")
        out["throughput_per_s"] = self.answered / self.seconds if self.seconds else 0.0
        out["first_errors"] = self.errors[:5]
        return out

    def table(self) -> str:
        s = self.summary()
        rows = [("clients", s["clients"]), ("duration (s)", f"{s['seconds']:.1f}"), ("sent", s["sent"]),
                ("answered", s["answered"]), ("refused (busy)", s["refused"]), ("failed", s["failed"]),
                ("lost", s["lost"]), ("latency p50 / p90 / p99 (s)", f"{s['p50_s']:.2f} / {s['p90_s']:.2f} / {s['p99_s']:.2f}"),
                ("answers per second", f"{s['throughput_per_s']:.2f}"),
                ("server memory before / after (MiB)", f"{s['memory_before_bytes'] / 2**20:.0f} / {s['memory_after_bytes'] / 2**20:.0f}")]
        if len(s["api_answers_per_replica"]) > 1:
            rows.append(("API answers per replica", _spread(s["api_answers_per_replica"])))
        if s["pages"]:
            rows += [("page sessions", s["pages"]),
                     ("page clicks answered / failed", f"{s['page_clicks_answered']} / {s['page_clicks_failed']}")]
            if len(s["page_clicks_per_replica"]) > 1:
                rows.append(("page clicks per replica", _spread(s["page_clicks_per_replica"])))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _spread(counts: dict[str, int]) -> str:
    return ", ".join(f"{name.rsplit('#', 1)[-1]} {count}" for name, count in sorted(counts.items()))


def request_body(image: bytes | None, max_tokens: int, question: str) -> dict:
    content = [{"type": "text", "text": question}]
    if image is not None:
        url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "pop": {"mode": "pop"}}


def server_memory(url: str) -> int:
    try:
        return int(httpx.get(url.rstrip("/") + "/healthz", timeout=10).json().get("memory_rss_bytes", 0))
    except (httpx.HTTPError, ValueError):
        return 0


def varied_image(image: bytes, index: int) -> bytes:
    """The image with one pixel changed per request: every request then carries a new image (no cache reuse)."""
    import io

    from PIL import Image

    picture = Image.open(io.BytesIO(image)).convert("RGB")
    picture.putpixel((index % picture.width, (index // picture.width) % picture.height),
                     ((index * 37) % 256, (index * 91) % 256, (index * 53) % 256))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def run_load(url: str, clients: int = 8, seconds: float = 30.0, *, max_requests: int = 10_000, max_tokens: int = 8,
             image: bytes | None = None, question: str = "What is in the picture?", timeout_s: float = 120.0,
             vary: bool = True, pages: int = 0) -> LoadReport:
    """Run the load; every client stops when the time is up or `max_requests` have been sent in all.

    With `vary` each request sends a different image (one pixel changed), so every request runs the vision
    encoder and the whole prefill; without it, repeated requests are served from the conversation cache.
    `pages` web-page sessions click "compare" on the same images meanwhile (they need an image)."""
    require_loopback(url)
    if not (0 <= clients <= 256 and 0 <= pages <= 64 and clients + pages >= 1 and 0 < seconds <= 3600
            and 1 <= max_requests <= 1_000_000):
        raise ValueError("clients must be 0..256, pages 0..64 (at least one of them), seconds 0..3600 and "
                         "max_requests 1..1e6")
    if pages and image is None:
        raise ValueError("page sessions upload an image: run them with one")
    report = LoadReport(clients=clients, seconds=seconds, pages=pages)
    report.memory_before_bytes = server_memory(url)
    load = _Load(url, report, time.monotonic() + seconds, max_requests, max_tokens, image, question, timeout_s, vary)
    threads = [threading.Thread(target=load.api_client, daemon=True) for _ in range(clients)]
    threads += [threading.Thread(target=load.page_session, args=(i,), daemon=True) for i in range(pages)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + timeout_s + 30)
    report.seconds = time.monotonic() - started
    report.memory_after_bytes = server_memory(url)
    return report


@dataclass
class _Load:
    """What the load's threads share: where to send, until when, and the report they fill in (under `lock`)."""

    url: str
    report: LoadReport
    deadline: float
    max_requests: int
    max_tokens: int
    image: bytes | None
    question: str
    timeout_s: float
    vary: bool
    lock: threading.Lock = field(default_factory=threading.Lock)

    def api_client(self) -> None:
        """One API client: requests one after the other until the time or the request budget is spent."""
        report, endpoint = self.report, self.url.rstrip("/") + "/v1/chat/completions"
        fixed_body = json.dumps(request_body(self.image, self.max_tokens, self.question))
        with httpx.Client(timeout=self.timeout_s) as http:
            while time.monotonic() < self.deadline:
                with self.lock:
                    if report.sent >= self.max_requests:
                        return
                    report.sent += 1
                    index = report.sent
                body = fixed_body
                if self.vary and self.image is not None:
                    body = json.dumps(request_body(varied_image(self.image, index), self.max_tokens, self.question))
                start = time.monotonic()
                try:
                    response = http.post(endpoint, content=body, headers={"content-type": "application/json"})
                except httpx.HTTPError as err:
                    with self.lock:
                        report.lost += 1
                        report.errors.append(f"lost: {type(err).__name__}: {err}")
                    continue
                self._count_api(response, time.monotonic() - start)

    def _count_api(self, response: httpx.Response, elapsed: float) -> None:
        report = self.report
        with self.lock:
            if response.status_code == 200 and _has_answer(response):
                report.answered += 1
                report.latencies_s.append(elapsed)
                replica = response.headers.get("x-pop-vlm-replica", "?")
                report.api_answers_per_replica[replica] = report.api_answers_per_replica.get(replica, 0) + 1
            elif response.status_code in (429, 503):
                report.refused += 1
            else:
                report.failed += 1
                report.errors.append(f"failed: HTTP {response.status_code}: {response.text[:200]}")

    def page_session(self, session: int) -> None:
        """One web-page session (a Gradio client with its own cookies, as a browser tab) clicking "compare"."""
        import tempfile

        from gradio_client import Client

        try:
            page = Client(self.url.rstrip("/") + "/", verbose=False)
        except Exception as err:  # noqa: BLE001 - the page did not even load: every click of it fails
            with self.lock:
                self.report.page_clicks_failed += 1
                self.report.errors.append(f"page {session} did not load: {type(err).__name__}: {err}")
            return
        home = page.cookies.get("pop_vlm_replica", "?")
        with tempfile.TemporaryDirectory() as folder:
            click = 0
            while time.monotonic() < self.deadline:
                click += 1
                path = Path(folder) / f"page{session}-{click}.png"
                path.write_bytes(varied_image(self.image, 1_000_000 * (session + 1) + click) if self.vary else self.image)
                ok, error = self._click(page, path, session)
                with self.lock:
                    if ok:
                        self.report.page_clicks_answered += 1
                        self.report.page_clicks_per_replica[home] = self.report.page_clicks_per_replica.get(home, 0) + 1
                    else:
                        self.report.page_clicks_failed += 1
                        self.report.errors.append(error)

    def _click(self, page, path: Path, session: int) -> tuple[bool, str | None]:
        from gradio_client import handle_file

        try:
            result = page.predict(handle_file(str(path)), self.question, "", "", self.max_tokens, api_name="/compare")
        except Exception as err:  # noqa: BLE001 - any failure of a click is counted, not raised
            return False, f"page {session}: {type(err).__name__}: {err}"
        if bool(result["full"]["token_ids"]) and bool(result["pop"]["token_ids"]):
            return True, None
        return False, f"page {session}: a click without an answer: {str(result)[:200]}"


def _has_answer(response: httpx.Response) -> bool:
    try:
        choice = response.json()["choices"][0]
    except (ValueError, KeyError, IndexError):
        return False
    return isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")


def default_image() -> bytes:
    from pop_vlm.zoo import assets_dir

    return (Path(assets_dir()) / "images" / "chelsea.jpg").read_bytes()
