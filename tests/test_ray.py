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
    # replicas report their load every second (default 10 s), so the autoscaling test sees it in seconds
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    ray_serve.init_local_ray(num_cpus=2, object_store_bytes=96 * 1024 * 1024, log_to_driver=False,
                             _node_ip_address="127.0.0.1")
    port = free_port()
    try:
        ray_serve.start({"model": tiny_model_dir, "device": "cpu", "replicas": 2, "num_cpus": 1,
                         "health_check_period_s": 2}, host="127.0.0.1", port=port)
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


def test_page_responses_name_the_replica_in_a_cookie_and_api_responses_do_not(tiny_model_dir):
    app = create_app(ModelManager(tiny_model_dir, device="cpu"), session_cookie=("pop_vlm_replica", "r1"))
    with LoopbackServer(app) as server, httpx.Client() as client:
        page = client.get(server.url + "/", timeout=30)
        config = client.get(server.url + "/config", timeout=30)
        api = [client.get(server.url + "/healthz", timeout=30), client.get(server.url + "/v1/models", timeout=30)]
    assert page.status_code == config.status_code == 200
    assert page.cookies.get("pop_vlm_replica") == config.cookies.get("pop_vlm_replica") == "r1"
    assert all(response.status_code == 200 and "set-cookie" not in response.headers for response in api)


def test_router_reads_the_home_replica_from_the_proxied_request():
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install '.[ray]')")
    import pickle
    from types import SimpleNamespace

    from app.ray_router import cookie_value, http_scope

    headers = [(b"host", b"x"), (b"cookie", b'theme=dark; broken; pop_vlm_replica="abc123" ; other=1')]
    assert cookie_value(headers, "pop_vlm_replica") == "abc123"
    assert cookie_value(headers, "other") == "1"
    assert cookie_value(headers, "missing") is None
    assert cookie_value([(b"cookie", b"pop_vlm_replica=")], "pop_vlm_replica") is None
    proxied = SimpleNamespace(args=[pickle.dumps(SimpleNamespace(asgi_scope={"path": "/", "headers": headers}))])
    assert http_scope(proxied)["headers"] == headers
    assert http_scope(SimpleNamespace(args=[b"not a pickle"])) is None
    assert http_scope(SimpleNamespace(args=["a handle call", 2])) is None
    assert http_scope(None) is None


def open_pages_on_both_replicas(url: str, at_least: int = 4, tries: int = 40) -> list:
    """Gradio clients, each like a browser tab with its own cookie jar; opened until both replicas serve some
    (the first request of a page goes to either replica)."""
    from gradio_client import Client

    from app.ray_router import SESSION_COOKIE

    clients, homes = [], set()
    for _ in range(tries):
        client = Client(url + "/", verbose=False)
        assert client.cookies.get(SESSION_COOKIE), client.cookies
        clients.append(client)
        homes.add(client.cookies[SESSION_COOKIE])
        if len(homes) == 2 and len(clients) >= at_least:
            return clients
    raise AssertionError(f"{tries} pages all went to the replicas {homes}")


def test_page_sessions_stay_on_their_replica(ray_server):
    """Uploads, queue entries and event streams of several pages at once, through two replicas: every click is
    answered (without affinity, about half of them hung up on the wrong replica)."""
    from gradio_client import handle_file

    from app.ray_router import SESSION_COOKIE
    from pop_vlm.zoo import assets_dir

    clients = open_pages_on_both_replicas(ray_server)
    image = str(assets_dir() / "images" / "chelsea.jpg")

    def two_clicks(client):
        return [client.predict(handle_file(image), "What animal is in the picture?", "", "2", 4, api_name="/compare")
                for _ in range(2)]

    with ThreadPoolExecutor(len(clients)) as pool:
        results = list(pool.map(two_clicks, clients))
    homes = [client.cookies[SESSION_COOKIE] for client in clients]
    print(f"\npages per replica: { {home: homes.count(home) for home in set(homes)} }, "
          f"{sum(map(len, results))} /compare clicks answered")
    for clicks in results:
        for result in clicks:
            assert result["full"]["token_ids"] and result["pop"]["token_ids"], result
            assert result["pop"]["pruned_layers"] == [4, 5]


def test_browser_pages_through_serve_and_a_page_whose_replica_died(ray_server):
    """Real Chromium tabs (one cookie jar each) on both replicas answer; then one tab's replica is killed: reloading
    the tab moves it to the live replica and it answers again, and Serve restores the replica."""
    import ray

    from app import ray_serve
    from app.ray_router import SESSION_COOKIE
    from pop_vlm.zoo import assets_dir

    from .test_browser import CHROMIUM, LAUNCH_ARGS, ask, text_contains  # skips when chromium is missing
    from playwright.sync_api import sync_playwright

    def home(context) -> str:
        return next(c["value"] for c in context.cookies() if c["name"] == SESSION_COOKIE)

    def answered(page, image: str, question: str):
        ask(page, assets_dir() / "images" / image, question)
        for side in ("#full-timing", "#pop-timing"):
            page.wait_for_function(text_contains(side, "TTFT"), timeout=90_000)
        assert page.input_value("#full-answer textarea").strip() and page.input_value("#pop-answer textarea").strip()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        tabs = []
        for _ in range(40):
            context = browser.new_context(viewport={"width": 1400, "height": 1100})
            page = context.new_page()
            page.goto(ray_server + "/")
            page.wait_for_selector("#question textarea", timeout=60_000)
            tabs.append((context, page))
            if len({home(c) for c, _ in tabs}) == 2:
                break
        first, other = tabs[0], next(tab for tab in tabs if home(tab[0]) != home(tabs[0][0]))
        for _, page in (first, other):
            answered(page, "chelsea.jpg", "What animal is in the picture?")

        victim = home(first[0])
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{ray_serve.APP_NAME}#{ray_serve.DEPLOYMENT_NAME}#{victim}",
                               namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        context, page = first
        page.goto(ray_server + "/")  # the router waits for Serve to drop the dead replica, then picks a live one
        page.wait_for_selector("#question textarea", timeout=90_000)
        answered(page, "coffee.jpg", "What is on the table?")
        moved_after_s = time.monotonic() - killed_at
        assert home(context) != victim
        answered(other[1], "coffee.jpg", "What is on the table?")  # the other replica's tab was never disturbed
        browser.close()
    ray_serve.wait_for_replicas(2, timeout_s=120)
    print(f"\nbrowser tabs opened: {len(tabs)}; the tab whose replica died answered again {moved_after_s:.1f} s "
          f"after the kill; 2 replicas running {time.monotonic() - killed_at:.1f} s after it")


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


def test_scaling_policy_counts_model_requests():
    from types import SimpleNamespace

    from app.ray_scaling import MODEL_REQUESTS, scale_on_model_requests

    def context(reported, queued=0.0, target=1.0, current=1):
        config = SimpleNamespace(get_target_ongoing_requests=lambda: target)
        return SimpleNamespace(aggregated_metrics={MODEL_REQUESTS: reported} if reported is not None else {},
                               total_queued_requests=queued, config=config, target_num_replicas=current)

    assert scale_on_model_requests(context({"a": 0.0, "b": 0.0}))[0] == 0
    assert scale_on_model_requests(context({"a": 3.0, "b": 1.0}))[0] == 4
    assert scale_on_model_requests(context({"a": 3.0, "b": 1.0}, queued=2.0, target=2.0))[0] == 3
    assert scale_on_model_requests(context(None, current=3))[0] == 3  # nothing reported yet: hold


def test_autoscaling_ignores_idle_pages_and_follows_model_requests(ray_server, tiny_model_dir):
    """Open pages hold long-lived connections (heartbeat streams) that Serve's default policy would count as load;
    ours scales on model requests: idle pages keep one replica, a stream of API requests brings the second."""
    from ray import serve

    from app import ray_serve

    name = "pop-vlm-auto"
    serve.run(ray_serve.build_app({"model": tiny_model_dir, "device": "cpu", "replicas": "auto", "min_replicas": 1,
                                   "max_replicas": 2, "num_cpus": 0, "upscale_delay_s": 1, "downscale_delay_s": 600,
                                   "look_back_period_s": 2, "health_check_period_s": 2}),
              name=name, route_prefix="/auto")
    ray_serve.wait_for_replicas(1, timeout_s=120, app_name=name)
    url = ray_server + "/auto"
    stop = threading.Event()
    opened = threading.Semaphore(0)

    def idle_page(session: int):
        with httpx.Client() as client, client.stream("GET", f"{url}/gradio_api/heartbeat/idle-{session}",
                                                     timeout=60) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # held: a dropped iterator would close the stream
            next(lines)
            opened.release()
            stop.wait(60)

    pages = [threading.Thread(target=idle_page, args=(i,), daemon=True) for i in range(8)]
    for page in pages:
        page.start()
    for _ in pages:
        assert opened.acquire(timeout=30)
    idle_replicas = 0
    watch_until = time.monotonic() + 15  # Serve's default policy counts the 8 streams and starts a second replica
    while time.monotonic() < watch_until:
        idle_replicas = max(idle_replicas, ray_serve.running_replicas(name, states=("RUNNING", "STARTING")))
        time.sleep(0.25)
    stats = {"answered": 0}

    def busy_client():
        with httpx.Client() as client:
            while not stop.is_set():
                response = chat(url, client, max_tokens=24)
                assert response.status_code == 200, response.text
                stats["answered"] += 1

    clients = [threading.Thread(target=busy_client, daemon=True) for _ in range(4)]
    loaded_at = time.monotonic()
    for client in clients:
        client.start()
    try:
        scaled_after_s = ray_serve.wait_for_replicas(2, timeout_s=90, app_name=name)
    finally:
        stop.set()
        for thread in [*pages, *clients]:
            thread.join(timeout=60)
        serve.delete(name)
    print(f"\nautoscaling: 8 idle pages -> {idle_replicas} replica(s); 4 busy API clients -> 2 replicas after "
          f"{scaled_after_s:.1f} s ({stats['answered']} answers in {time.monotonic() - loaded_at:.1f} s)")
    assert idle_replicas == 1


@pytest.mark.parametrize("source", ["deploy/ray-serve.yaml", "deploy/kuberay-rayservice.yaml"])
def test_committed_serve_configs_are_valid(source):
    """Both committed Serve configs pass Serve's own schema, and their builder args give valid deployment options
    (the request router and autoscaling policy import and validate)."""
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install '.[ray]')")
    from pathlib import Path

    import yaml
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig
    from ray.serve.schema import ServeDeploySchema

    from app import ray_serve

    document = yaml.safe_load((Path(__file__).resolve().parent.parent / source).read_text())
    if document.get("kind") == "RayService":
        document = yaml.safe_load(document["spec"]["serveConfigV2"])
    config = ServeDeploySchema.model_validate(document)
    (application,) = config.applications
    assert application.import_path == "app.ray_serve:build_app"
    options = ray_serve.deployment_options(application.args)
    router = RequestRouterConfig(**options["request_router_config"])
    assert router.get_request_router_class().__name__ == "BrowserSessionRouter"
    autoscaling = AutoscalingConfig(**options["autoscaling_config"])
    assert autoscaling.policy.get_policy().__name__ == "scale_on_model_requests"
    assert options["max_ongoing_requests"] >= 32
