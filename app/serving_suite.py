"""The serving benchmark's sweep: for each model, a serial server (one request at a time) and a batched one
(continuous batching), each started as `pop-vlm serve` in a process of its own on loopback, measured in each mode
at each client count (`serving_bench`); then the batched answers checked against the serial ones, prompt by prompt.

The servers run with the prefix cache off (POP_VLM_PREFIX_CACHE_BYTES=0), so that every request prefills its whole
prompt whatever came before it, and with glibc's allocator kept off mmap for large blocks (as `pop-vlm bench`
does), so that page faults do not blur the comparison.
"""
from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import httpx

from .loadtest import varied_image
from .serving_bench import run_clients, summarize

ROOT = Path(__file__).resolve().parent.parent
SHAPE_QUESTIONS = ("What color is the circle?", "What shape is the red object?", "How many shapes are there?",
                   "Is there a blue square?", "What color is the triangle?", "Is the green circle on the left or the right?")
PHOTO_QUESTIONS = ("Describe the picture.", "What is in the image?", "What colors do you see?",
                   "Tell me about this photo in detail.")
TOPICS = ("the history of Rome", "how bread is baked", "the life of honeybees", "volcanoes", "the first railways",
          "a lighthouse keeper", "the moons of Jupiter", "chess openings", "a storm at sea", "coffee farming",
          "the printing press", "a mountain village", "whales", "clocks and watches", "a desert journey",
          "the northern lights")
FORMS = ("Write a short story about {}.", "Explain {} to a child.", "Here are some facts about {}:",
         "A poem about {}:")


@dataclass(frozen=True)
class Workload:
    """A model and the requests sent to it. Request i carries prompt i % `distinct`: its question, and for VLMs an
    image of `images` with a few pixels changed per prompt (`varied_image`), resized to `image_side`² if set."""

    name: str
    max_tokens: int
    questions: tuple[str, ...]
    images: tuple[str, ...] = ()
    image_side: int | None = None
    distinct: int = 16
    arch: tuple[str, float] | None = None  # (architecture, width scale): random weights, saved for the server

    def prompt(self, index: int) -> int:
        return index % self.distinct

    def body(self, index: int, mode: str) -> bytes:
        return _body(self, self.prompt(index), mode)


@lru_cache(maxsize=512)
def _body(workload: Workload, prompt: int, mode: str) -> bytes:
    question = workload.questions[prompt % len(workload.questions)]
    content: list[dict] = [{"type": "text", "text": question}]
    if workload.images:
        image = _asset_image(workload.images[prompt % len(workload.images)], workload.image_side)
        url = "data:image/png;base64," + base64.b64encode(varied_image(image, prompt)).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": workload.max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "pop": {"mode": mode}}).encode()


@lru_cache(maxsize=16)
def _asset_image(name: str, side: int | None) -> bytes:
    from PIL import Image

    from pop_vlm.zoo import assets_dir

    data = (Path(assets_dir()) / "images" / name).read_bytes()
    if side is None:
        return data
    buffer = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").resize((side, side)).save(buffer, format="PNG")
    return buffer.getvalue()


WORKLOADS = {
    "shapes-qwen3-vl": Workload("shapes-qwen3-vl", 4, SHAPE_QUESTIONS,
                                images=("shapes_1.png", "shapes_2.png", "shapes_3.png", "shapes_4.png")),
    "gemma-3-270m": Workload("gemma-3-270m", 64, tuple(FORMS[i % len(FORMS)].format(t) for i, t in enumerate(TOPICS))),
    "qwen3-vl-2b-s0.25": Workload("qwen3-vl-2b-s0.25", 64, PHOTO_QUESTIONS,
                                  images=("astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"), image_side=256,
                                  arch=("qwen3-vl-2b", 0.25)),
}


@contextmanager
def model_for(workload: Workload):
    """What the server is given as --model: the name, or a folder with the random-weight model saved in it."""
    if workload.arch is None:
        yield workload.name
        return
    from pop_vlm import archs

    with tempfile.TemporaryDirectory(prefix="serving-bench-") as folder:
        yield str(archs.save_pretrained(workload.arch[0], folder, scale=workload.arch[1]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(model: str, max_batch_size: int, *, device: str = "cpu", dtype: str = "auto",
                   threads: int | None = 1, queue_size: int = 256, startup_s: float = 900.0):
    """`pop-vlm serve` on a free loopback port in a process of its own; yields its URL once /healthz is ready."""
    port = free_port()
    command = [sys.executable, "-m", "pop_vlm.cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--device", device, "--dtype", dtype, "--max-batch-size", str(max_batch_size),
               "--queue-size", str(queue_size), "--log-level", "warning"]
    if threads:
        command += ["--threads", str(threads)]
    env = {**os.environ, **SERVER_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process, log, startup_s)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


SERVER_ENV = {"POP_VLM_PREFIX_CACHE_BYTES": "0", "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
              "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def _wait_ready(url: str, process, log, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read().decode(errors='replace')[-3000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {url} was not ready within {timeout_s:.0f} s")


def health(url: str) -> dict:
    return httpx.get(url + "/healthz", timeout=30).json()


def wait_idle(url: str, timeout_s: float = 300.0) -> dict:
    """/healthz once no request runs or waits (cancelled requests leave the queue when their turn comes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = health(url)
        if (state.get("running", 0) == 0 and state.get("queue_length", 0) == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


@dataclass
class SuiteConfig:
    """One sweep; the command line's defaults are these."""

    models: tuple[str, ...] = tuple(WORKLOADS)
    kinds: tuple[str, ...] = ("serial", "batched")
    modes: tuple[str, ...] = ("full", "pop")
    clients: tuple[int, ...] = (1, 4, 16, 32)
    per_client: int = 2  # requests each client sends at most, back to back
    seconds: float = 30.0  # no request is sent after this; requests not admitted by then are cancelled
    batch_size: int = 0  # the batched server's --max-batch-size (0: the most clients, at least 2)
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = 1

    def max_batch_size(self, kind: str) -> int:
        return 1 if kind == "serial" else (self.batch_size or max(2, *self.clients))


def run_suite(config: SuiteConfig, log=print) -> dict:
    """Measure every (model, server kind, mode, clients); {"meta": ..., "rows": [...]}."""
    rows, answers = [], {}
    for name in config.models:
        workload = WORKLOADS[name]
        with model_for(workload) as model:
            for kind in config.kinds:
                started = time.perf_counter()
                with server_process(model, config.max_batch_size(kind), device=config.device, dtype=config.dtype,
                                    threads=config.threads) as url:
                    log(f"{name}: {kind} server ready in {time.perf_counter() - started:.0f} s")
                    for mode in config.modes:  # warm-up: one request per mode
                        run_clients(url, lambda i, m=mode: workload.body(i, m), 1, 1)
                    for clients in config.clients:
                        for mode in config.modes:
                            row = _measure(url, workload, kind, mode, clients, config, answers)
                            rows.append(row)
                            log(f"  {kind:7} {mode:4} {clients:3} clients: {row['completed']}/{row['sent']} done, "
                                f"{row['tokens_per_s']:.1f} tok/s, TTFT p99 {row['ttft_p99_s']:.2f} s, "
                                f"{row['rows_per_step']:.1f} rows/step")
        check_answers(rows, answers, name)
    return {"meta": meta(config), "rows": rows}


def _measure(url: str, workload: Workload, kind: str, mode: str, clients: int, config: SuiteConfig,
             answers: dict) -> dict:
    before = wait_idle(url)
    records, wall = run_clients(url, lambda i: workload.body(i, mode), clients, config.per_client, config.seconds)
    after = wait_idle(url)
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    decoded = after.get("decode_rows", 0) - before.get("decode_rows", 0)
    answers.setdefault((workload.name, mode, kind), []).extend(
        (workload.prompt(r.index), r.text, clients) for r in records if r.completed)
    return {"model": workload.name, "server": kind, "max_batch_size": config.max_batch_size(kind), "mode": mode,
            "clients": clients, "max_tokens": workload.max_tokens, **summarize(records, wall, workload.max_tokens),
            # a serial server has no scheduler: one row per decode step by construction
            "rows_per_step": decoded / steps if steps else 1.0, "decode_steps": steps}


def check_answers(rows: list[dict], answers: dict, model: str) -> None:
    """Each batched row: how many of its answers had a serial answer for the same prompt and mode to compare with,
    and how many differed from it; each serial row: answers that differ from another serial answer to the prompt."""
    for row in (r for r in rows if r["model"] == model):
        serial = {}
        for prompt, text, _ in answers.get((model, row["mode"], "serial"), []):
            serial.setdefault(prompt, set()).add(text)
        mine = [(p, t) for p, t, c in answers.get((model, row["mode"], row["server"]), []) if c == row["clients"]]
        compared = [(p, t) for p, t in mine if p in serial]
        if row["server"] == "serial":
            row["compared"], row["mismatches"] = len(compared), sum(1 for p, _ in compared if len(serial[p]) > 1)
        else:
            row["compared"], row["mismatches"] = len(compared), sum(1 for p, t in compared if t not in serial[p])


def meta(config: SuiteConfig) -> dict:
    import datetime
    import platform

    import torch
    import transformers

    from pop_vlm.memory import machine_description

    device = torch.device("cuda" if config.device.startswith("cuda") else "cpu")
    from pop_vlm.loading import resolve_dtype

    return {**asdict(config), "max_tokens": {name: WORKLOADS[name].max_tokens for name in config.models},
            "dtype_resolved": str(resolve_dtype(config.dtype, device)).split(".")[-1],
            "machine": machine_description(device) if device.type == "cpu" or torch.cuda.is_available() else config.device,
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "server_env": SERVER_ENV,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": None}
