"""The HTTP API (OpenAI client), the health check, and the Gradio `/compare` endpoint, on a tiny model."""
from __future__ import annotations

import base64
import json
import threading

import openai
import pytest
from fastapi.testclient import TestClient

from app.models import ModelManager
from app.server import create_app

from .serving import LoopbackServer

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from pop_vlm import zoo

    return str(zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("served-model")))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    manager = ModelManager(tiny_model_dir, device="cpu")
    with LoopbackServer(create_app(manager)) as running:
        yield running


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    from pop_vlm.zoo import assets_dir

    return str(assets_dir() / "images" / "chelsea.jpg")


def data_url(path: str) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(open(path, "rb").read()).decode()


def image_message(path: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(path)}},
                                         {"type": "text", "text": text}]}]


def test_healthz_is_503_while_loading_and_200_after(tiny_model_dir):
    release = threading.Event()

    class SlowManager(ModelManager):
        def load_default(self):
            release.wait(timeout=60)
            super().load_default()

    manager = SlowManager(tiny_model_dir, device="cpu")
    client = TestClient(create_app(manager))
    loading = client.get("/healthz")
    assert loading.status_code == 503 and loading.json()["status"] == "loading"
    refused = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 503 and "loading" in refused.json()["error"]["message"]
    release.set()
    manager.ready.wait(timeout=60)
    ready = client.get("/healthz")
    assert ready.status_code == 200
    assert ready.json()["model"] == tiny_model_dir and ready.json()["device"] == "cpu"


@pytest.mark.parametrize("pop", [None, {"mode": "pop", "prune_layers": 2}, {"mode": "full"}])
def test_openai_client_completion_with_image(server, image_path, pop):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    extra = {"pop": pop} if pop else {}
    response = client.chat.completions.create(model="", messages=image_message(image_path), max_tokens=6,
                                              temperature=0, extra_body=extra)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens >= 1 and response.usage.prompt_tokens > 10
    body = response.model_dump()
    assert body["timings"]["ttft_s"] > 0 and body["timings"]["prefill_s"] > 0
    assert body["pop"]["mode"] == (pop or {}).get("mode", "pop")
    assert body["pop"]["n_image_tokens"] > 0
    expected_pruned = [4, 5] if (pop or {}).get("mode", "pop") == "pop" else []
    assert body["pop"]["pruned_layers"] == expected_pruned


def test_openai_client_streaming_matches_non_streaming(server, image_path):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kwargs = dict(model="", messages=image_message(image_path), max_tokens=8, temperature=0,
                  extra_body={"pop": {"mode": "pop", "prune_layers": 2}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    last = chunks[-1].model_dump()
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["timings"]["ttft_s"] > 0


@pytest.mark.parametrize("body, status, param", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "pop": {"mode": "fast"}}, 400, "pop.mode"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "no such model!"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "   "}]}, 400, "messages"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, param):
    import httpx

    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], top_p=7)


def test_models_endpoint_lists_the_default(server, tiny_model_dir):
    import httpx

    ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert tiny_model_dir in ids


def test_gradio_compare_returns_both_answers_and_timings(server, image_path):
    from gradio_client import Client, handle_file

    client = Client(server.url + "/", verbose=False)
    result = client.predict(handle_file(image_path), QUESTION, "", "2", 5, api_name="/compare")
    for mode in ("full", "pop"):
        assert result[mode]["mode"] == mode
        assert result[mode]["token_ids"] and isinstance(result[mode]["text"], str)
        assert result[mode]["timings"]["ttft_s"] > 0
    assert result["pop"]["pruned_layers"] == [4, 5] and result["full"]["pruned_layers"] == []
    assert result["ttft_speedup"] > 0 and result["lm_speedup"] > 0
    # one preprocessing and one vision pass, shared: both sides report the same measurement
    full, pop = result["full"]["timings"], result["pop"]["timings"]
    assert full["vision_s"] > 0 and full["preprocess_s"] > 0
    assert (full["preprocess_s"], full["vision_s"]) == (pop["preprocess_s"], pop["vision_s"])
    assert result["shared"] == {"preprocess_s": pop["preprocess_s"], "vision_s": pop["vision_s"]}
    with pytest.raises(Exception, match="question"):
        client.predict(handle_file(image_path), "  ", "", "2", 5, api_name="/compare")
    again = client.predict(None, QUESTION, "", "1", 3, api_name="/compare")
    assert again["pop"]["pruned_layers"] == [5]


@pytest.fixture(scope="module")
def shapes_client():
    """The bundled demo model, which ends its one-word answers with its end-of-turn token."""
    return TestClient(create_app(ModelManager("shapes-qwen3-vl", device="cpu"), load_in_background=False))


def test_ignore_eos_decodes_exactly_max_tokens(shapes_client):
    from pop_vlm.zoo import assets_dir

    messages = image_message(str(assets_dir() / "images" / "shapes_1.png"), "What color is the circle?")
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    natural = shapes_client.post("/v1/chat/completions", json=body).json()
    assert natural["choices"][0]["finish_reason"] == "stop" and natural["usage"]["completion_tokens"] < 6
    forced = shapes_client.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json()
    assert forced["choices"][0]["finish_reason"] == "length" and forced["usage"]["completion_tokens"] == 6
    assert forced["choices"][0]["message"]["content"] == natural["choices"][0]["message"]["content"]
    stream = {**body, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with shapes_client.stream("POST", "/v1/chat/completions", json=stream) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 6
    legacy = shapes_client.post("/v1/completions", json={"prompt": "what color", "max_tokens": 5, "temperature": 0,
                                                         "ignore_eos": True}).json()
    assert legacy["choices"][0]["finish_reason"] == "length" and legacy["usage"]["completion_tokens"] == 5
    refused = shapes_client.post("/v1/chat/completions", json={**body, "ignore_eos": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "ignore_eos"


def test_worker_threads_cover_every_admitted_request(tmp_path):
    """Each running or queued request holds a worker thread: with fewer, running streams could not send."""
    import anyio.to_thread
    from fastapi.testclient import TestClient

    from app.limits import Limits
    from pop_vlm import zoo

    model_dir = zoo.save_tiny("tiny-qwen3", tmp_path / "tiny")
    manager = ModelManager(str(model_dir), device="cpu", limits=Limits(queue_size=100, max_batch_size=16))
    with TestClient(create_app(manager, load_in_background=False)) as client:
        async def threads():
            return anyio.to_thread.current_default_thread_limiter().total_tokens

        assert client.portal.call(threads) >= 16 + 100
