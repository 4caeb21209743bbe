"""The host's allocator and memory: glibc tuning that keeps large activations off mmap, bytes in use, the peak
during a block (CUDA: the allocator's own), and a one-line description of the machine, for benchmarks."""
from __future__ import annotations

import ctypes
import os
import platform
import threading
import time

import torch


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_malloc() -> bool:
    """Keep freed memory in glibc's heap: no mmap/munmap and page faults for every large activation.

    The same as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set high in the environment; without it the full
    path pays page faults on every layer and looks slower than it is.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 40) == 1 and ok)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class HostMemory:
    """Bytes the process has allocated from glibc right now (in use, not resident): torch's CPU tensors live there."""

    def __init__(self):
        libc = _libc()
        self.fn = getattr(libc, "mallinfo2", None) if libc is not None else None
        if self.fn is not None:
            self.fn.restype = _MallInfo2

    @property
    def available(self) -> bool:
        return self.fn is not None

    def in_use(self) -> int:
        info = self.fn()
        return int(info.uordblks + info.hblkhd)


class PeakWatcher:
    """Peak bytes in use above the level at start, during a block. CUDA: the allocator's own peak; CPU: glibc's
    in-use bytes sampled every 0.2 ms by a thread (used on untimed runs only)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = HostMemory() if device.type != "cuda" else None
        self.peak = 0
        self.base = 0
        self._stop = threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.host.available:
            self.base = self.peak = self.host.in_use()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.host.in_use())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.host.available:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.host.in_use())
        return False

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.base)


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs"
