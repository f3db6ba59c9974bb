"""What a rank reads about itself besides time: memory in use, CPU load, hardware indicators."""
from __future__ import annotations

import math
import os
import time
from typing import Dict, Optional, Tuple

import torch

from hetlb.core.checks import number


def meminfo(path: str = "/proc/meminfo") -> Optional[Tuple[int, int]]:
    """``(available, total)`` bytes of RAM from Linux's ``/proc/meminfo`` (``MemAvailable`` and
    ``MemTotal``, the figures ``psutil.virtual_memory()`` reports there), or None where the file
    or either line is missing (another OS, a kernel older than 3.14)."""
    try:
        with open(path, "rb", buffering=0) as f:
            text = f.read(4096)
    except OSError:
        return None
    found = {}
    for line in text.split(b"\n"):
        key, _, rest = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable"):
            parts = rest.split()
            if len(parts) != 2 or parts[1] != b"kB" or not parts[0].isdigit():
                return None
            found[key] = int(parts[0]) * 1024
            if len(found) == 2:
                return found[b"MemAvailable"], found[b"MemTotal"]
    return None


class Probe:
    """Reads the memory fraction in use for this rank's telemetry row.

    CUDA: ``1 - free / total`` of the device from ``torch.cuda.mem_get_info`` (every process's
    allocations, as LB-BSP's memory guard needs). CPU: ``1 - available / total`` RAM, read from
    ``/proc/meminfo`` on Linux (:func:`meminfo`; psutil's figure, at a sixth of psutil's cost),
    elsewhere through psutil. Readings are refreshed at most every ``interval`` seconds and reused
    in between (memory does not change meaningfully within milliseconds).
    """

    def __init__(self, device: Optional[torch.device] = None, interval: float = 0.2) -> None:
        import psutil
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.interval = number(interval, "Probe: interval", minimum=0.0)
        self._psutil = psutil
        self._at = -math.inf
        self._last = 0.0
        # psutil parses all of /proc/meminfo in Python (~90 µs, several times that with cold
        # caches, every `interval` inside the training loop's step boundary); the two numbers it
        # reports are the file's first and third lines.
        self._proc = self.device.type != "cuda" and meminfo() is not None

    def memory(self) -> float:
        """Fraction of the device's memory (CUDA) or of RAM (CPU) in use, in [0, 1]."""
        now = time.monotonic()
        if now - self._at >= self.interval:
            self._at = now
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
            else:
                got = meminfo() if self._proc else None
                if got is None:
                    vm = self._psutil.virtual_memory()
                    got = (vm.available, vm.total)
                free, total = got
            self._last = min(max(1.0 - float(free) / float(total), 0.0), 1.0) if total else 0.0
        return self._last


def hardware_info(device: Optional[torch.device] = None) -> Dict[str, float]:
    """Static indicators of this rank's hardware, for policies that start from them (WLBS).

    Keys: ``cpus`` (logical CPUs this process may use), ``cores`` (physical cores of the machine),
    ``memory`` (bytes of RAM), and on CUDA ``gpu_sms`` (multiprocessors), ``gpu_clock`` (kHz, 0
    if unknown), ``gpu_memory`` (bytes).
    """
    import psutil
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cpus = float(os.cpu_count() or 1)
    cores = float(psutil.cpu_count(logical=False) or cpus)
    info: Dict[str, float] = {"cpus": cpus, "cores": cores, "memory": float(psutil.virtual_memory().total)}
    if device is not None and torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["gpu_sms"] = float(p.multi_processor_count)
        info["gpu_clock"] = float(getattr(p, "clock_rate", 0) or 0)
        info["gpu_memory"] = float(p.total_memory)
    return info
