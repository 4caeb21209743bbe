"""A server on loopback for the tests: the FastAPI app with the Gradio page, run by uvicorn in a thread."""
from __future__ import annotations

import socket
import threading
import time
import urllib.request

import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackServer:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        self.wait_until_ready()
        return self

    def wait_until_ready(self, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the server at {self.url} did not become ready")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=5)
        if self.thread.is_alive():  # a graceful shutdown waits for clients' open connections (Gradio's event streams)
            self.server.force_exit = True
            self.thread.join(timeout=25)
