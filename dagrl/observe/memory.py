"""Host and device memory of this worker process, for per-node memory metrics and trace counters.

Host: the resident set size now (`/proc/self/statm` on Linux, read in a few microseconds), the
process's peak RSS (`getrusage`), and each node's own peak, sampled by a thread while the node
runs (the kernel's high-water mark can be reset, /proc/self/clear_refs, but that resets
`ru_maxrss` too, which the process's peak and the benches read). Device: the peak of memory
allocated by tensors since the last reset (the caching allocator's count, not what the driver
reports), reset before each node so that the peak belongs to that node.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time

import torch

from dagrl.device import peak_memory_bytes, reset_peak_memory

GB = 1024 ** 3
# How often the host sampler reads the RSS while a node runs. A tensor that lives for less than
# this may be missed; the ones that set a training step's peak (activations, optimizer states,
# logits chunks kept for backward) live for the whole forward and backward of a micro-batch.
SAMPLE_EVERY_S = 0.01


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


class HostPeakSampler:
    """The highest RSS of this process while tasks run, per open task: a daemon thread reads it
    every SAMPLE_EVERY_S while any task is open and sleeps otherwise. Tasks nest: a nested
    task's peak counts towards the enclosing task's."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S) -> None:
        self.every_s = every_s
        self._peaks: list[int] = []     # per open task, innermost last
        self._lock = threading.Lock()
        self._busy = threading.Event()  # set while a task is open
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            self._peaks.append(host_rss_bytes())
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, name="dagrl-rss-sampler",
                                            daemon=True)
            self._thread.start()
        self._busy.set()

    def stop(self) -> tuple[int, int]:
        """(the RSS now, the task's peak RSS, its end included) in bytes."""
        now = host_rss_bytes()
        with self._lock:
            peak = max(self._peaks.pop(), now)
            if self._peaks:
                self._peaks[-1] = max(self._peaks[-1], peak)
            else:
                self._busy.clear()
        return now, peak

    def _sample(self) -> None:
        while True:
            self._busy.wait()
            rss = host_rss_bytes()
            with self._lock:
                if self._peaks:
                    self._peaks[-1] = max(self._peaks[-1], rss)
            time.sleep(self.every_s)


class NodeMemory:
    """Brackets tasks: `start()` before, `stop()` after -> (host RSS at the end, host peak
    during the task, device peak) in bytes (device peak None on the CPU). Tasks may nest
    (DAPO's filter re-runs earlier tasks from inside its node): a nested task's peak still
    counts towards the enclosing task's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = HostPeakSampler()
        self._open: list[int] = []      # per open task: the highest peak of tasks it enclosed

    def start(self) -> None:
        if self._open:                  # the reset below would lose the enclosing task's peak
            self._open[-1] = max(self._open[-1], peak_memory_bytes(self.device) or 0)
        self._open.append(0)
        reset_peak_memory(self.device)
        self.host.start()

    def stop(self) -> tuple[int, int, int | None]:
        host, host_peak = self.host.stop()
        enclosed = self._open.pop()
        peak = peak_memory_bytes(self.device)
        if peak is not None:
            peak = max(peak, enclosed)
            if self._open:
                self._open[-1] = max(self._open[-1], peak)
        return host, host_peak, peak
