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

from dagrl.device import peak_memory_bytes, reset_peak_memory

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
    """Brackets tasks: `start()` before, `stop()` after -> (host RSS, device peak) in bytes
    (device peak None on the CPU). Tasks may nest (DAPO's filter re-runs earlier tasks from
    inside its node): a nested task's peak still counts towards the enclosing task's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._open: list[int] = []      # per open task: the highest peak of tasks it enclosed

    def start(self) -> None:
        if self._open:                  # the reset below would lose the enclosing task's peak
            self._open[-1] = max(self._open[-1], peak_memory_bytes(self.device) or 0)
        self._open.append(0)
        reset_peak_memory(self.device)

    def stop(self) -> tuple[int, int | None]:
        enclosed = self._open.pop()
        peak = peak_memory_bytes(self.device)
        if peak is not None:
            peak = max(peak, enclosed)
            if self._open:
                self._open[-1] = max(self._open[-1], peak)
        return host_rss_bytes(), peak
