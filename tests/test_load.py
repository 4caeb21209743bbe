"""A short concurrent load on loopback: every request is answered or refused, none failed, none lost; web-page
sessions clicking meanwhile are all answered; streaming clients of a batched server share its decode steps, and a
client that goes away frees its place at once."""
from __future__ import annotations

import gc
import threading
import time

import httpx
import pytest

from app.limits import Limits
from app.loadtest import default_image, require_loopback, run_load
from app.models import ModelManager
from app.server import create_app
from app.serving_bench import run_clients, summarize
from app.serving_suite import Workload

from .serving import LoopbackServer


def test_load_test_refuses_non_loopback_targets():
    for url in ("http://10.0.0.1:7860", "http://192.168.1.2", "http://example.org"):
        with pytest.raises(ValueError):
            require_loopback(url)
    require_loopback("http://127.0.0.1:7860")


def test_eight_clients_and_two_pages_thirty_seconds_nothing_failed_or_lost(tmp_path):
    from pop_vlm import zoo

    model_dir = zoo.save_tiny("tiny-qwen3-vl", tmp_path / "tiny")
    with LoopbackServer(create_app(ModelManager(str(model_dir), device="cpu"))) as server:
        report = run_load(server.url, clients=8, seconds=30, max_requests=2000, max_tokens=4, image=default_image(),
                          pages=2)
    summary = report.summary()
    print(report.table())
    assert summary["failed"] == 0, summary["first_errors"]
    assert summary["lost"] == 0, summary["first_errors"]
    assert summary["answered"] >= 8
    assert summary["sent"] == summary["answered"] + summary["refused"]
    assert summary["page_clicks_failed"] == 0, summary["first_errors"]
    assert summary["page_clicks_answered"] >= 2


def test_page_sessions_need_an_image():
    with pytest.raises(ValueError, match="image"):
        run_load("http://127.0.0.1:9", clients=0, pages=1, seconds=1)


@pytest.fixture(scope="module")
def batched_server(tmp_path_factory):
    from pop_vlm import zoo

    model_dir = zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("tiny-batched"))
    manager = ModelManager(str(model_dir), device="cpu", limits=Limits(max_batch_size=8))
    with LoopbackServer(create_app(manager)) as server:
        yield server


def test_eight_streaming_clients_of_a_batched_server_share_decode_steps(batched_server):
    workload = Workload("tiny", 32, ("What is in the picture?", "Describe it."), images=("chelsea.jpg",),
                        image_side=64)
    records, wall = run_clients(batched_server.url, lambda i: workload.body(i, "pop" if i % 2 else "full"),
                                clients=8, per_client=2)
    summary = summarize(records, wall, workload.max_tokens)
    assert summary["failed"] == 0 and summary["lost"] == 0, summary["first_errors"]
    assert summary["completed"] == 16 and summary["wrong_length"] == 0
    assert summary["ttft_p99_s"] > 0 and summary["tokens_per_s"] > 0
    health = httpx.get(batched_server.url + "/healthz", timeout=30).json()
    assert health["decode_steps"] > 0 and health["rows_per_step"] > 1, health
    assert health["running"] == 0 and health["batch_size"] == 0


def test_a_streaming_client_that_goes_away_leaves_the_batch_at_once(batched_server):
    """Its generation is closed when its stream ends, not when the garbage collector gets to it: meanwhile it
    would hold a place in the admission, and a batch row that every step waits for."""
    url = batched_server.url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True,
            "stream": True, "temperature": 0}
    done = threading.Event()

    def long_request():
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            for _ in response.iter_lines():
                pass
        done.set()

    runner = threading.Thread(target=long_request)
    gc.disable()  # the server runs in this process: no collection may rescue a leaked generator here
    try:
        runner.start()
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
        deadline, health = time.monotonic() + 2.0, {}
        while time.monotonic() < deadline and not done.is_set():
            health = httpx.get(batched_server.url + "/healthz", timeout=30).json()
            if health["running"] == 1 and health["batch_size"] <= 1:
                break
            time.sleep(0.05)
    finally:
        gc.enable()
    runner.join(timeout=120)
    assert health.get("running") == 1 and health.get("batch_size", 9) <= 1, health
