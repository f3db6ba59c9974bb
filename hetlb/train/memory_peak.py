"""Memory probes: the peak bytes in use during one call (for :func:`hetlb.profile`'s
``memory_limit`` and its memory prediction): CUDA's allocator statistics, Linux's RSS high-water
mark, or an RSS sampler thread elsewhere."""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

import torch

__all__ = ["CudaPeak", "ProcHWMPeak", "SampledPeak", "memory_probe"]

class CudaPeak:
    """Peak of ``torch.cuda.memory_allocated`` during a call (the caching allocator's stats)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


def _load_malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        import ctypes

        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim() if os.name == "posix" else None


def _trim_heap() -> None:
    """glibc keeps freed blocks resident; give them back so the RSS counts live memory only.

    Without this, a size's freed tensors stay in the RSS and inflate the next size's peak."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class ProcHWMPeak:
    """Linux: reset the process's RSS high-water mark (``clear_refs`` 5), then read ``VmHWM``.

    Exact and cheap (tens of microseconds). It resets the process-wide peak that ``VmHWM`` (not
    ``ru_maxrss``) reports, which nothing else in hetlb reads.
    """

    @staticmethod
    def available() -> bool:
        try:
            ProcHWMPeak().start()
            return ProcHWMPeak._read("VmHWM:") > 0
        except (OSError, ValueError):
            return False

    @staticmethod
    def _read(key: str) -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise ValueError(f"{key} not in /proc/self/status")

    def current(self) -> int:
        _trim_heap()
        return self._read("VmRSS:")

    def start(self) -> None:
        _trim_heap()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")

    def stop(self) -> int:
        return self._read("VmHWM:")


class SampledPeak:
    """Elsewhere: a thread samples the RSS (psutil) every millisecond during the call."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self._peak = 0
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def current(self) -> int:
        _trim_heap()
        return self._rss()

    def _rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._done.wait(0.001):
            self._peak = max(self._peak, self._rss())

    def start(self) -> None:
        self._peak = self.current()
        self._done.clear()
        self._thread = threading.Thread(target=self._run, name="hetlb-profile-rss", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        return max(self._peak, self._rss())


def memory_probe(dev: torch.device, needed: bool) -> Any:
    """The probe for ``dev``; ``None`` when measuring would cost time and nobody asked for it."""
    if dev.type == "cuda":
        return CudaPeak(dev)
    if dev.type == "cpu":
        if ProcHWMPeak.available():
            return ProcHWMPeak()
        if needed:
            return SampledPeak()
        return None
    if needed:
        raise ValueError(f"memory_limit is not supported on device type {dev.type!r}")
    return None
