"""A short concurrent load on loopback: every request is answered or refused, none failed, none lost; web-page
sessions clicking meanwhile are all answered."""
from __future__ import annotations

import pytest

from app.loadtest import default_image, require_loopback, run_load
from app.models import ModelManager
from app.server import create_app

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
