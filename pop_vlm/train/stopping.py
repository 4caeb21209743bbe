"""Stopping a training run from outside without losing its last step: signals become a request the loop reads."""
from __future__ import annotations

import signal
import threading


class StopRequest:
    """While active, SIGTERM and SIGINT only ask the loop to stop after the current step (a second one acts as
    usual), so that a run ended from outside still writes its checkpoint."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._before: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._before = {sig: signal.signal(sig, self._request) for sig in self.SIGNALS}
        return self

    def _request(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, self._before[signum])

    def __exit__(self, *exc):
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
