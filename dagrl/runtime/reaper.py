"""Stops the local Ray instance a dagrl driver started, when the driver dies without stopping it.

`ray.shutdown()` stops everything on a clean exit, and the driver turns SIGTERM into a clean
exit. A driver killed outright (kill -9, the OOM killer) runs no code: Ray's GCS server and
raylet die with it, but processes they started (the dashboard and runtime-env agents) live on
as orphans. So the driver starts this small process first (stdlib only: it must start fast
and must not import torch), and tells it the pids of the processes `ray.init` started. The
reaper follows their descendants, and:

- reads "done" on stdin: the driver shut Ray down itself; exit;
- sees stdin close without "done": the driver died; SIGKILL every process it has followed
  (checking each one's start time, so a reused pid is never hit), then exit.

Run as a script: `python .../dagrl/runtime/reaper.py` (no package import). Linux only (/proc);
elsewhere it exits at once and Ray's own fate-sharing is all there is.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys

POLL_S = 0.25


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()   # the command name may hold spaces
    if fields[0] == b"Z":   # a zombie has exited already
        return None
    return int(fields[1]), int(fields[19])


def descendants(roots: dict[int, int]) -> dict[int, int]:
    """`roots` (pid -> start time) and every live descendant of theirs."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = proc_stat(int(name))
            if found is not None:
                children.setdefault(found[0], []).append(int(name))
                starts[int(name)] = found[1]
    out = {pid: start for pid, start in roots.items() if starts.get(pid) == start}
    todo = list(out)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out[child] = starts[child]
                todo.append(child)
    return out


def main() -> int:
    if not os.path.isdir("/proc"):
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C is the driver's to handle
    first = sys.stdin.readline()
    if not first:
        return 0
    roots = {pid: stat[1] for pid in json.loads(first) if (stat := proc_stat(pid)) is not None}
    followed = dict(roots)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready:
            line = sys.stdin.readline()
            if line.strip() == "done":
                return 0
            if not line:   # the driver is gone without shutting Ray down
                break
        followed.update(descendants(roots | followed))
    for pid, start in followed.items():
        stat = proc_stat(pid)
        if stat is not None and stat[1] == start:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
