"""Who may run what: only the operator's models load (404 model_not_found for anything else, decided before any
loading or fetching), and API keys guard /v1/* and the page while /healthz stays open."""
from __future__ import annotations

import hmac

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import pop_vlm
from app import auth
from app.models import ModelError, ModelManager, served_models
from app.openai_api import ImageFetchPolicy
from app.server import create_app
from pop_vlm.cli import build_parser
from pop_vlm.cli import main as cli_main

from .serving import LoopbackServer

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from pop_vlm import zoo

    return str(zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("served-model")))


@pytest.fixture(scope="module")
def tiny_pipeline(tiny_model_dir):
    return pop_vlm.load(tiny_model_dir, device="cpu")


@pytest.fixture
def loads(monkeypatch, tiny_model_dir, tiny_pipeline):
    """Every model load the server attempts, by name; the served folder loads (once, from memory), others fail as
    an offline hub or an unreadable folder would."""
    calls: list[str] = []

    def recording_load(name, **_):
        calls.append(name)
        if name == tiny_model_dir:
            return tiny_pipeline
        raise OSError(f"cannot read {name}")

    monkeypatch.setattr(pop_vlm, "load", recording_load)
    return calls


@pytest.fixture
def fetches(monkeypatch):
    """Remote image fetches (none may happen for a request that names an unserved model)."""
    calls: list[str] = []

    def recording_urlopen(url, *_, **__):
        calls.append(url)
        raise OSError("no network in the tests")

    monkeypatch.setattr("app.openai_api.urllib.request.urlopen", recording_urlopen)
    return calls


def unserved_names(tmp_path, tiny_model_dir) -> list[str]:
    folder = tmp_path / "some-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return ["Qwen/Qwen3-VL-2B-Instruct", str(folder), "../..", "/", tiny_model_dir + "/.", "shapes-qwen3-vl",
            "gemma-3-270m"]


def test_unserved_models_get_404_before_any_loading_or_fetching(tmp_path, tiny_model_dir, loads, fetches):
    manager = ModelManager(served=[tiny_model_dir], device="cpu")
    client = TestClient(create_app(manager, policy=ImageFetchPolicy(allow_remote=True), load_in_background=False))
    assert loads == [tiny_model_dir]  # the default model, at start
    loads.clear()
    remote_image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}
    for name in unserved_names(tmp_path, tiny_model_dir):
        body = {"model": name, "messages": [{"role": "user", "content": [remote_image, {"type": "text", "text": "hi"}]}]}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 404, (name, response.text)
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and "not served" in error["message"]
        with pytest.raises(ModelError, match="not served"):  # what the page's model box gets
            manager.get(name)
    assert loads == [] and fetches == []
    assert client.post("/v1/chat/completions", json={"model": 7, "messages": HELLO}).status_code == 400


def test_served_models_answer_and_are_exactly_what_v1_models_lists(tiny_model_dir, loads):
    manager = ModelManager(served=[tiny_model_dir], device="cpu")
    client = TestClient(create_app(manager, load_in_background=False))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [tiny_model_dir] == manager.choices()
    for name in (tiny_model_dir, "", None):
        body = {"messages": HELLO, "max_tokens": 2, **({"model": name} if name is not None else {})}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == tiny_model_dir
    assert loads == [tiny_model_dir]


def test_default_list_is_the_default_model_and_the_bundled_demo_models(tiny_model_dir):
    from pop_vlm import zoo

    manager = ModelManager(tiny_model_dir, device="cpu")
    assert manager.choices()[0] == tiny_model_dir
    assert set(zoo.available_bundled()) <= set(manager.choices())
    with pytest.raises(ModelError, match="not served"):
        manager.check_name("Qwen/Qwen3-VL-2B-Instruct")


def test_allow_any_model_restores_loading_hub_ids_and_folders(tmp_path, tiny_model_dir, loads):
    folder = tmp_path / "other"
    folder.mkdir()
    manager = ModelManager(served=[tiny_model_dir], device="cpu", allow_any=True)
    for name in (str(folder), "someone/some-model"):
        with pytest.raises(ModelError, match="cannot load"):
            manager.get(name)
    assert loads == [str(folder), "someone/some-model"]
    confined = ModelManager(served=[tiny_model_dir], device="cpu", allow_any=True, allowed_root=str(folder))
    with pytest.raises(ModelError, match="must lie under"):
        confined.get(str(tmp_path))
    assert loads == [str(folder), "someone/some-model"]


def test_served_list_from_flags_then_environment():
    assert served_models(["b", "a", "b"], {"POP_VLM_MODELS": "x"}) == ["b", "a"]
    assert served_models(None, {"POP_VLM_MODELS": " x, y ,,x"}) == ["x", "y"]
    assert served_models(None, {}) is None
    args = build_parser().parse_args(["serve", "--model", "m1", "--model", "m2", "--allow-any-model"])
    assert args.model == ["m1", "m2"] and args.allow_any_model


@pytest.fixture
def captured_serve(monkeypatch):
    """Run `pop-vlm serve` up to the point where it would listen: what it built, and no server started."""
    import uvicorn

    import app.server

    built = {}

    def fake_create_app(manager, **kwargs):
        built.update(manager=manager, **kwargs)
        return "app"

    monkeypatch.setattr(app.server, "create_app", fake_create_app)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: built.update(listen=k))
    for name in ("POP_VLM_MODELS", "POP_VLM_API_KEY", "POP_VLM_UI_AUTH"):
        monkeypatch.delenv(name, raising=False)
    return built


def test_serve_command_passes_models_and_keys_and_warns_when_exposed(captured_serve, capsys, monkeypatch):
    assert cli_main(["serve", "--host", "0.0.0.0", "--model", "a/b", "--model", "c/d"]) == 0
    assert captured_serve["manager"].choices() == ["a/b", "c/d"] and captured_serve["manager"].default == "a/b"
    assert not captured_serve["manager"].allow_any and captured_serve["api_keys"] == ()
    assert "without an API key" in capsys.readouterr().err

    monkeypatch.setenv("POP_VLM_API_KEY", "k1,k2")
    monkeypatch.setenv("POP_VLM_MODELS", "e/f")
    assert cli_main(["serve", "--host", "0.0.0.0", "--ui-auth", "alice:secret"]) == 0
    assert captured_serve["api_keys"] == ("k1", "k2") and captured_serve["ui_auth"] == [("alice", "secret")]
    assert captured_serve["manager"].choices() == ["e/f"]
    assert "warning" not in capsys.readouterr().err

    monkeypatch.delenv("POP_VLM_API_KEY")
    assert cli_main(["serve"]) == 0  # loopback: no key needed, no warning
    assert "warning" not in capsys.readouterr().err
    assert cli_main(["serve", "--api-key", "has space"]) == 2
    assert "visible ASCII" in capsys.readouterr().err


def test_key_comparison_is_constant_time_over_all_keys(monkeypatch):
    compared = []
    real = hmac.compare_digest

    def recording(a, b):
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    assert auth.key_matches("first", ["first", "second", "third"])
    assert compared == [b"first", b"second", b"third"]  # no early exit on a match
    assert not auth.key_matches("firs", ["first"]) and not auth.key_matches("", ["first"])
    assert auth.exposure_warning("::1", []) is None and auth.exposure_warning("localhost", []) is None
    assert auth.exposure_warning("0.0.0.0", []) and auth.exposure_warning("example.org", [])


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    manager = ModelManager(served=[tiny_model_dir], device="cpu")
    with LoopbackServer(create_app(manager, api_keys=("key-one", "key-two"))) as running:
        yield running


def test_v1_needs_a_key_and_healthz_does_not(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"},
                    {"Authorization": "Basic key-one"}):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"messages": HELLO})):
            response = httpx.request(method, url + path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.headers["www-authenticate"].startswith("Bearer") and response.headers["x-pop-vlm-replica"]
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.json()["error"]["type"] == "invalid_request_error"
            assert "key-one" not in response.text
    for key in ("key-one", "key-two"):
        response = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200


def test_openai_client_with_and_without_the_key_streaming_too(keyed_server):
    kwargs = dict(model="", messages=HELLO, max_tokens=3, temperature=0)
    wrong = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(**kwargs)
    with pytest.raises(openai.AuthenticationError):
        list(wrong.chat.completions.create(stream=True, **kwargs))
    right = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="key-two")
    whole = right.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in right.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole


def test_page_behind_the_key(keyed_server):
    from gradio_client import Client

    url = keyed_server.url
    for path in ("/config", "/gradio_api/info"):
        assert httpx.get(url + path).status_code == 401
    assert httpx.post(url + "/login", data={"username": "anyone", "password": "wrong"}).status_code == 400
    assert httpx.post(url + "/login", data={"username": "anyone", "password": "key-one"}).json() == {"success": True}
    with pytest.raises(Exception, match="(?i)login|credentials"):
        Client(url + "/", verbose=False)
    result = Client(url + "/", verbose=False, auth=("anyone", "key-two")).predict(
        None, "hello", "", "1", 2, api_name="/compare")
    assert result["pop"]["token_ids"] and result["full"]["token_ids"]


def test_page_with_its_own_users(tiny_model_dir, tiny_pipeline, monkeypatch):
    monkeypatch.setattr(pop_vlm, "load", lambda *a, **k: tiny_pipeline)
    manager = ModelManager(served=[tiny_model_dir], device="cpu")
    client = TestClient(create_app(manager, api_keys=("key-one",), ui_auth=[("alice", "s3cret")],
                                   load_in_background=False))
    assert client.post("/login", data={"username": "alice", "password": "s3cret"}).status_code == 200
    assert client.post("/login", data={"username": "bob", "password": "key-one"}).status_code == 400
    assert client.get("/v1/models", headers={"Authorization": "Bearer key-one"}).status_code == 200
