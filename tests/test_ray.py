"""Scale-out on Ray Serve: two CPU replicas of a tiny model behind the same API; load spreads over both (seen in the
`x-pop-vlm-replica` header) and killing one while requests are in flight loses none, and Serve restores it."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.models import ModelManager
from app.server import REPLICA_HEADER, create_app

from .serving import LoopbackServer, free_port

pytestmark = pytest.mark.ray

MESSAGES = [{"role": "user", "content": "Say something about the colour of the sky, please."}]
RETRYABLE = {500, 502, 503, 504}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from pop_vlm import zoo

    return str(zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("ray-model")))


def test_single_process_names_its_process(tiny_model_dir):
    with LoopbackServer(create_app(ModelManager(tiny_model_dir, device="cpu"))) as server:
        health = httpx.get(server.url + "/healthz", timeout=30)
        answer = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                            json={"messages": MESSAGES, "max_tokens": 2})
        page = httpx.get(server.url + "/", timeout=30)
    assert health.status_code == answer.status_code == page.status_code == 200
    assert health.headers[REPLICA_HEADER] == answer.headers[REPLICA_HEADER] == page.headers[REPLICA_HEADER]
    assert health.headers[REPLICA_HEADER].endswith(f":{os.getpid()}")


@pytest.fixture(scope="module")
def ray_server(tiny_model_dir):
    pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install '.[ray]')")
    import ray
    from ray import serve

    from app import ray_serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray_serve.init_local_ray(num_cpus=2, object_store_bytes=96 * 1024 * 1024, log_to_driver=False,
                             _node_ip_address="127.0.0.1")
    port = free_port()
    try:
        ray_serve.start({"model": tiny_model_dir, "device": "cpu", "replicas": 2, "num_cpus": 1,
                         "max_ongoing_requests": 2, "health_check_period_s": 2}, host="127.0.0.1", port=port)
        ray_serve.wait_for_replicas(2, timeout_s=150)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(url: str, client: httpx.Client, max_tokens: int = 12) -> httpx.Response:
    return client.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": max_tokens,
                                                           "temperature": 0}, timeout=60)


def test_same_api_and_page_through_serve(ray_server):
    with httpx.Client() as client:
        health = client.get(ray_server + "/healthz", timeout=30)
        page = client.get(ray_server + "/", timeout=30)
        models = client.get(ray_server + "/v1/models", timeout=30)
        answer = chat(ray_server, client, max_tokens=3)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert page.status_code == 200 and "gradio" in page.text.lower()
    assert models.status_code == 200 and models.json()["data"]
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"
    assert answer.headers[REPLICA_HEADER].startswith("pop-vlm#PopVLM#")


def test_requests_spread_over_both_replicas(ray_server):
    def one(_):
        with httpx.Client() as client:
            response = chat(ray_server, client)
        assert response.status_code == 200, response.text
        return response.headers[REPLICA_HEADER]

    with ThreadPoolExecutor(6) as pool:
        served = list(pool.map(one, range(16)))
    spread = {name: served.count(name) for name in set(served)}
    print(f"\nreplica spread over {len(served)} requests: {spread}")
    assert len(spread) == 2, spread


def test_killing_a_replica_loses_no_request(ray_server):
    import ray

    from app import ray_serve

    stats = {"sent": 0, "answered": 0, "retried": 0, "attempts_failed": 0, "lost": 0}
    lock = threading.Lock()
    served: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def client_loop():
        with httpx.Client() as client:
            while not stop.is_set():
                with lock:
                    stats["sent"] += 1
                for attempt in range(10):
                    try:
                        response = chat(ray_server, client)
                        if response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None:
                            with lock:
                                stats["answered"] += 1
                                stats["retried"] += attempt > 0
                                served.append(response.headers[REPLICA_HEADER])
                            break
                        assert response.status_code in RETRYABLE, (response.status_code, response.text)
                        failure = str(response.status_code)
                    except httpx.TransportError as err:
                        failure = type(err).__name__
                    with lock:
                        failures.append(failure)
                        stats["attempts_failed"] += 1
                    time.sleep(0.25 * (attempt + 1))
                else:
                    with lock:
                        stats["lost"] += 1

    workers = [threading.Thread(target=client_loop, daemon=True) for _ in range(4)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 60
    while len(set(served)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = served[-1]
    assert ray_serve.running_replicas() == 2
    ray.kill(ray.get_actor("SERVE_REPLICA::" + victim, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    answered_at_kill = stats["answered"]
    # Serve notices the death and starts a replacement; requests keep being answered meanwhile
    deadline = killed_at + 120
    while time.monotonic() < deadline and ray_serve.running_replicas() >= 2:
        time.sleep(0.05)  # until the controller has marked the replica dead (it may already have)
    ray_serve.wait_for_replicas(2, timeout_s=max(1.0, deadline - time.monotonic()))
    recovery_s = time.monotonic() - killed_at
    replacement_seen = time.monotonic() + 60
    while time.monotonic() < replacement_seen and not (set(served) - {victim} - set(served[:answered_at_kill])):
        time.sleep(0.1)
    stop.set()
    for worker in workers:
        worker.join(timeout=120)
    print(f"\nkill test: {stats}, answered after the kill: {stats['answered'] - answered_at_kill}, "
          f"failed attempts: {failures}, recovery to 2 RUNNING replicas: {recovery_s:.1f} s, replicas seen: {sorted(set(served))}")
    assert stats["lost"] == 0 and stats["answered"] == stats["sent"], stats
    assert stats["answered"] > answered_at_kill
    new = set(served) - set(served[:answered_at_kill])
    assert new - {victim}, "the replacement replica answered no request"
