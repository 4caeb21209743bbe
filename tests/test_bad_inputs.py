"""Every bad input gets a clear error (HTTP 4xx in OpenAI's shape, or the page's error message) or a correct
answer — never a traceback — and the server answers a good request afterwards."""
from __future__ import annotations

import base64

import httpx
import pytest

from app.models import ModelManager
from app.server import create_app

from .bad_inputs import IMAGES, QUESTIONS, encode, picture
from .serving import LoopbackServer

GOOD_QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pop_vlm import zoo

    return zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    manager = ModelManager(str(model_dir), device="cpu", allowed_root=str(model_dir.parent))
    with LoopbackServer(create_app(manager)) as running:
        yield running


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(image_url: str | None = None, text: str = GOOD_QUESTION, **extra) -> dict:
    content = [{"type": "text", "text": text}]
    if image_url is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0, **extra}


def post(server, body, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(server.url + "/v1/chat/completions", content=raw,
                          headers={"content-type": "application/json"}, timeout=120)
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def assert_still_serving(server):
    response = post(server, chat(data_url(encode(picture()))))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def assert_outcome(response: httpx.Response, expected: str):
    if expected == "ok":
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] >= 1 and body["timings"]["ttft_s"] > 0
        return
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text}"
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert expected.lower() in error["message"].lower(), error["message"]
    assert "Traceback" not in error["message"]


REQUESTS = {
    "invalid-json": (None, b"{not json", "JSON"),
    "body-is-a-list": ([1, 2], None, "object"),
    "no-messages": ({"max_tokens": 3}, None, "messages"),
    "bad-role": ({"messages": [{"role": "robot", "content": "hi"}]}, None, "role"),
    "content-is-a-number": ({"messages": [{"role": "user", "content": 42}]}, None, "content"),
    "audio-part": ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, None, "type"),
    "data-url-not-base64": (chat("data:image/png,rawbytes"), None, "base64"),
    "data-url-bad-base64": (chat("data:image/png;base64,@@notbase64@@"), None, "base64"),
    "ftp-url": (chat("ftp://example.org/cat.png"), None, "data: URL"),
    "remote-url-disabled": (chat("https://example.org/cat.png"), None, "disabled"),
    "empty-url": (chat(""), None, "data: URL"),
    "unknown-model": (chat(model="no such model"), None, "not served"),
    "model-path-not-served": (chat(model="/"), None, "not served"),
    "hub-model-not-served": (chat(model="nobody-here/does-not-exist-anywhere"), None, "not served"),
    "model-not-a-string": (chat(model=["a"]), None, "model"),
    "temperature-negative": (chat(temperature=-1), None, "temperature"),
    "temperature-too-high": (chat(temperature=7), None, "temperature"),
    "top-p-zero": (chat(top_p=0), None, "top_p"),
    "top-p-above-one": (chat(top_p=1.5), None, "top_p"),
    "max-tokens-zero": (chat(max_tokens=0), None, "max_tokens"),
    "max-tokens-huge": (chat(max_tokens=10**9), None, "max_tokens"),
    "max-tokens-text": (chat(max_tokens="ten"), None, "max_tokens"),
    "seed-text": (chat(seed="abc"), None, "seed"),
    "pop-mode-unknown": (chat(pop={"mode": "turbo"}), None, "mode"),
    "pop-not-object": (chat(pop="fast"), None, "pop"),
    "prune-too-many": (chat(pop={"mode": "pop", "prune_layers": 99}), None, "out of range"),
    "prune-negative": (chat(pop={"mode": "pop", "prune_layers": -1}), None, "out of range"),
    "prune-deepstack": (chat(pop={"mode": "pop", "prune_layers": 5}), None, "deepstack"),
    "prune-word": (chat(pop={"mode": "pop", "prune_layers": "most"}), None, "prune_layers"),
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_files_through_http(server, name):
    make, expected = IMAGES[name]
    assert_outcome(post(server, chat(data_url(make()))), expected)
    assert_still_serving(server)


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_questions_through_http(server, name):
    question, expected = QUESTIONS[name]
    assert_outcome(post(server, chat(data_url(encode(picture())), text=question)), expected)
    assert_still_serving(server)


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_malformed_requests_through_http(server, name):
    body, raw, expected = REQUESTS[name]
    assert_outcome(post(server, body, raw), expected)
    assert_still_serving(server)


def compare(server, image_path, question=GOOD_QUESTION, model="", prune="2", max_new_tokens=3):
    from gradio_client import Client, handle_file

    client = Client(server.url + "/", verbose=False)
    return client.predict(handle_file(image_path) if image_path else None, question, model, prune, max_new_tokens,
                          api_name="/compare")


GRADIO_CASES = {
    **{f"image-{name}": ("image", name) for name in IMAGES},
    **{f"question-{name}": ("question", name) for name in QUESTIONS},
    "unknown-model": ("model", "no such model"),
    "hub-model-not-served": ("model", "nobody-here/does-not-exist-anywhere"),
    "prune-too-many": ("prune", "99"),
    "prune-word": ("prune", "most"),
    "max-new-tokens-zero": ("max_new_tokens", 0),
    "max-new-tokens-huge": ("max_new_tokens", 100000),
}


@pytest.mark.parametrize("case", sorted(GRADIO_CASES))
def test_bad_inputs_through_gradio_compare(server, tmp_path, case):
    kind, value = GRADIO_CASES[case]
    image_path = tmp_path / "upload.png"
    image_path.write_bytes(encode(picture()))
    kwargs, expected = {}, "error"
    if kind == "image":
        make, expected = IMAGES[value]
        image_path.write_bytes(make())
    elif kind == "question":
        kwargs["question"], expected = QUESTIONS[value]
    elif kind == "model":
        kwargs["model"], expected = value, "not served"
    elif kind == "prune":
        kwargs["prune"] = value
    else:
        kwargs["max_new_tokens"] = value
    if expected == "ok":
        result = compare(server, str(image_path), **kwargs)
        assert result["full"]["token_ids"] and result["pop"]["token_ids"]
    else:
        with pytest.raises(Exception) as err:
            compare(server, str(image_path), **kwargs)
        message = str(err.value)
        assert message and "Traceback" not in message
        if expected != "error":
            assert expected.lower() in message.lower(), message
    good = compare(server, None)
    assert good["full"]["token_ids"] and good["pop"]["token_ids"]
