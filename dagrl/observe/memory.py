"""Host and device memory of this worker process, for per-node memory metrics and trace counters.

Host: the resident set size now (`/proc/self/statm` on Linux, read in a few microseconds) and
the process's peak RSS (`getrusage`). Device: the peak of memory allocated by tensors since the
last reset (the caching allocator's count, not what the driver reports), reset before each node
so that the peak belongs to that node.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

from dagrl.runtime.device import peak_memory_bytes, reset_peak_memory

GB = 1024 ** 3


def host_rss_bytes() -> int:
    """Resident set size of this process now (its peak where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return host_peak_bytes()


def host_peak_bytes() -> int:
    """Peak resident set size of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # bytes on macOS, KiB on Linux


class NodeMemory:
    """Brackets one task: `start()` before, `stop()` after -> (host RSS, device peak) in bytes
    (device peak None on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        reset_peak_memory(self.device)

    def stop(self) -> tuple[int, int | None]:
        return host_rss_bytes(), peak_memory_bytes(self.device)
