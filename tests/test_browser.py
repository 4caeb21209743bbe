"""The web page in a real browser: Playwright driving Debian's Chromium, headless."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from app.models import ModelManager
from app.server import create_app

from .serving import LoopbackServer

ARTIFACTS = Path(os.environ.get("POP_VLM_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]

if CHROMIUM is None:
    if os.environ.get("CI"):
        raise RuntimeError("the browser tests need Debian's chromium (apt-get install chromium); .ci/run installs it")
    pytest.skip("chromium is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    from pop_vlm import zoo

    model_dir = str(zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("browser-model")))
    with LoopbackServer(create_app(ModelManager(model_dir, device="cpu"))) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(server.url + "/")
        page.wait_for_selector("#question textarea", timeout=60_000)
        yield page
        browser.close()


def text_contains(selector: str, needle: str) -> str:
    return f"() => {{ const e = document.querySelector('{selector}'); return !!e && e.innerText.includes('{needle}'); }}"


def ask(page, image: Path, question: str):
    page.set_input_files("#image input[type=file]", str(image))
    page.fill("#question textarea", question)
    page.click("#run")


def test_page_answers_both_ways_with_timings(page):
    from pop_vlm.zoo import assets_dir

    ask(page, assets_dir() / "images" / "chelsea.jpg", "What animal is in the picture?")
    for side in ("#full-timing", "#pop-timing"):
        page.wait_for_function(text_contains(side, "TTFT"), timeout=60_000)
    page.wait_for_function(text_contains("#speedup", "speedup"), timeout=30_000)
    assert page.input_value("#full-answer textarea").strip()
    assert page.input_value("#pop-answer textarea").strip()
    assert "prefill skips layers" in page.inner_text("#pop-timing")
    headline = page.inner_text("#speedup")
    assert "TTFT speedup" in headline and "LM-only speedup" in headline and "Shared by both sides" in headline
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "app.png"), full_page=True)
    assert (ARTIFACTS / "app.png").stat().st_size > 10_000


def test_bad_upload_shows_error_and_app_keeps_serving(page, tmp_path):
    from pop_vlm.zoo import assets_dir

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"this is not a picture")
    ask(page, broken, "What is this?")
    page.wait_for_selector("text=as an image", timeout=30_000)
    page.reload()
    page.wait_for_selector("#question textarea", timeout=60_000)
    ask(page, assets_dir() / "images" / "coffee.jpg", "What is on the table?")
    for side in ("#full-timing", "#pop-timing"):
        page.wait_for_function(text_contains(side, "TTFT"), timeout=60_000)


def test_chat_follow_up_reuses_the_conversation_cache(page):
    from pop_vlm.zoo import assets_dir

    page.get_by_role("tab", name="Chat about an image").click()
    page.set_input_files("#chat-image input[type=file]", str(assets_dir() / "images" / "rocket.jpg"))
    page.fill("#chat-question textarea", "What is being launched?")
    page.press("#chat-question textarea", "Enter")
    page.wait_for_function(text_contains("#chat-timing", "reused"), timeout=60_000)
    assert "0 of" in page.inner_text("#chat-timing")  # the first turn has nothing to reuse
    page.fill("#chat-question textarea", "And where?")
    page.press("#chat-question textarea", "Enter")
    page.wait_for_function(
        "() => { const e = document.querySelector('#chat-timing'); return !!e && /TTFT/.test(e.innerText) "
        "&& !e.innerText.includes(' 0 of'); }", timeout=60_000)
    reused = int(page.inner_text("#chat-timing").split("—")[1].split(" of ")[0])
    assert reused > 10
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)
