"""The Ray instance a run uses, and its shutdown on every way out of the driver.

`RAY_ADDRESS` set: join that cluster (it is not ours to stop). Otherwise start a local instance
and stop it when the run ends:

- returning or raising: `ray.shutdown()` in a `finally`;
- SIGTERM (a scheduler, `kill`): turned into SystemExit while Ray is up, so the `finally` runs;
- kill -9 / the OOM killer: no code of ours runs; the reaper (runtime/reaper.py), a small
  process started beside Ray, sees the driver's pipe close and kills what Ray left behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dagrl.runtime import reaper
from dagrl.runtime.failures import sigterm_exits


def _children(pid: int) -> set[int]:
    """The live child processes of `pid` (Linux /proc; empty elsewhere)."""
    if not Path("/proc").is_dir():
        return set()
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = reaper.proc_stat(int(name))
            if stat is not None and stat[0] == pid:
                found.add(int(name))
    return found


def _start_reaper() -> subprocess.Popen | None:
    if not Path("/proc").is_dir():
        return None
    # Its own session: a Ctrl-C or a terminal hang-up aimed at the driver must not stop it.
    return subprocess.Popen([sys.executable, "-S", reaper.__file__], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, text=True)


@contextlib.contextmanager
def ray_session(n_workers: int) -> Iterator[None]:
    """Ray for the duration of the block (see the module docstring)."""
    import ray

    if ray.is_initialized():   # the caller's own Ray: theirs to manage
        yield
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        try:
            with sigterm_exits():
                yield
        finally:
            ray.shutdown()
        return
    # Ray enables token authentication for a new local instance and warns that it did unless
    # the mode is set: set it to what Ray does anyway (the user's own setting wins).
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    reaper_proc = _start_reaper()
    before = _children(os.getpid())
    try:
        # A local instance: CPU workers may outnumber the cores (each is one process).
        ray.init(num_cpus=max(n_workers, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=True, logging_level=logging.WARNING)
        if reaper_proc is not None:
            started = sorted(_children(os.getpid()) - before - {reaper_proc.pid})
            reaper_proc.stdin.write(json.dumps(started) + "\n")
            reaper_proc.stdin.flush()
        # After ray.init: Ray's core installs a SIGTERM handler of its own that aborts the
        # process (no finally, no shutdown); ours replaces it while the run lasts.
        with sigterm_exits():
            yield
    finally:
        if ray.is_initialized():
            # Let Ray's log monitor forward the workers' last lines before it stops.
            time.sleep(1.0)
            ray.shutdown()
        if reaper_proc is not None:
            with contextlib.suppress(OSError):
                reaper_proc.stdin.write("done\n")
                reaper_proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper_proc.wait(timeout=5)
