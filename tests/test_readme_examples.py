"""The README's examples, read from README.md, run as written: those that call the server against live servers
built as `pop-vlm serve` builds them with its defaults (the bundled default model; one without and one with an API
key), those that use the bundled model in a fresh process. Only the server's address is changed (a free port)."""
from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.models import ModelManager
from app.server import create_app

from .serving import LoopbackServer

ROOT = Path(__file__).resolve().parent.parent
BASE = "http://127.0.0.1:7860"
KEY = "readme-test-key"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w+)\n(?P<code>.*?)^(?P=indent)```$", re.M | re.S)


def readme_examples() -> list[tuple[str, str]]:
    """(language, code) of the python blocks that talk to the server or read the bundled images, and of the bash
    blocks that call the server with curl or answer with `pop-vlm answer` on a bundled image."""
    blocks = []
    for match in FENCE.finditer((ROOT / "README.md").read_text()):
        lang, indent = match["lang"], len(match["indent"])
        code = "\n".join(line[indent:] for line in match["code"].splitlines()) + "\n"
        if lang == "python" and (BASE in code or "assets/images/" in code):
            blocks.append((lang, code))
        elif lang == "bash" and ("curl " in code or "pop-vlm answer " in code) and "assets/images/" in code or \
                lang == "bash" and "curl " in code and BASE in code:
            blocks.append((lang, code))
    return blocks


EXAMPLES = readme_examples()


def example_id(example) -> str:
    lang, code = example
    first = next(line for line in code.splitlines() if line.strip() and not line.startswith(("import", "from")))
    return f"{lang}:{first[:40]}"


def test_the_readme_has_the_examples_this_test_expects():
    python_api = [c for lang, c in EXAMPLES if lang == "python" and BASE in c]
    curl = [c for lang, c in EXAMPLES if lang == "bash" and "curl" in c]
    library = [c for _, c in EXAMPLES if BASE not in c]
    assert len(python_api) >= 3 and len(curl) >= 2 and len(library) >= 2, EXAMPLES
    assert any("--data-binary @" in c for c in curl)  # the body from a file: images of any size
    assert not re.search(r"photo\.jpg|prune_layers.: *9|prune-layers 9", "".join(c for _, c in EXAMPLES))


@pytest.fixture(scope="module")
def servers():
    """Two servers as `make serve` starts them (defaults, no model named): one open, one with an API key."""
    saved = {name: os.environ.pop(name) for name in ("POP_VLM_MODEL", "POP_VLM_MODELS") if name in os.environ}
    try:
        with LoopbackServer(create_app(ModelManager())) as open_server, \
                LoopbackServer(create_app(ModelManager(), api_keys=(KEY,))) as keyed_server:
            yield {"open": open_server, "keyed": keyed_server}
    finally:
        os.environ.update(saved)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Like the repository's root (the examples read assets/images/) but writable (curl's request.json)."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "assets").symlink_to(ROOT / "assets")
    return folder


def run_example(lang: str, code: str, workdir: Path, env: dict) -> subprocess.CompletedProcess:
    if lang == "python":
        script = workdir / "example.py"
        script.write_text(code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("example", EXAMPLES, ids=[example_id(e) for e in EXAMPLES])
def test_readme_example_runs_as_written(example, servers, workdir):
    lang, code = example
    keyed = "POP_VLM_API_KEY" in code
    server = servers["keyed" if keyed else "open"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("POP_VLM_MODEL", None)
    if keyed:
        env["POP_VLM_API_KEY"] = KEY
    result = run_example(lang, code.replace(BASE, server.url), workdir, env)
    assert result.returncode == 0, f"{code}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.stdout.strip() and "Traceback" not in result.stderr
    if "What color is the triangle?" in code:
        assert "yellow" in result.stdout.lower(), result.stdout  # the image arrived and the default model read it
    if "curl" in code:
        body = json.loads(result.stdout)
        assert "error" not in body, body
        if "/v1/chat/completions" in code:
            assert body["timings"]["ttft_s"] > 0 and body["pop"]["mode"] == "pop"
        if "/v1/models" in code:
            assert "shapes-qwen3-vl" in [model["id"] for model in body["data"]]


def test_stated_defaults_and_the_prefix_cache(servers):
    """What the README says of a request without `pop`, and of a repeated image (about 0 ms vision)."""
    url = servers["open"].url + "/v1/chat/completions"
    image = "data:image/png;base64," + base64.b64encode((ROOT / "assets/images/shapes_3.png").read_bytes()).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "How many shapes are there?"}]}],
            "temperature": 0, "max_tokens": 4}
    first = httpx.post(url, json=body, timeout=120).json()
    again = httpx.post(url, json=body, timeout=120).json()
    assert first["model"] == "shapes-qwen3-vl" and first["pop"]["mode"] == "pop"
    assert first["pop"]["pruned_layers"] == [4, 5]  # L/3 of the default model's 6 layers
    assert first["timings"]["n_cached_tokens"] == 0 and first["timings"]["vision_s"] > 0.002
    # a cached image skips the vision tower: what is left is bookkeeping, far below the first request's pass
    assert again["timings"]["n_cached_tokens"] > 0 and again["timings"]["vision_s"] < first["timings"]["vision_s"] / 5
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
