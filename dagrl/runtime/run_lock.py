"""One live run per run directory.

Two runs writing the same directory corrupt each other's checkpoints and metrics (a relaunch
while the workers of a killed driver were still training did exactly that). The launching
process (the Ray driver, the single worker, torchrun's rank 0) holds an exclusive `flock` on
`<run_dir>/run.lock`, and every worker holds a shared one on `<run_dir>/workers/lock`:

- a second launch finds `run.lock` locked and is refused, with the holder's pid, host and start
  time (written into the file) in the message;
- the kernel drops a lock when its process dies however it dies (kill -9, OOM), so a lock left
  by a dead run is simply taken over — the file's old record only says whose it was;
- the newcomer also takes `workers/lock` exclusively for a moment: it waits (briefly) until no
  worker of the previous run is alive, so a relaunch never shares the directory with them.

A clean exit empties `run.lock` before unlocking it, so only a crashed holder leaves a record.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from dagrl.runtime.failures import append_run_log
from dagrl.runtime.run_dir import RunDirError

LOCK_FILE = "run.lock"
WORKERS_LOCK = Path("workers") / "lock"


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _record(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


def _describe(record: dict) -> str:
    if not record:
        return "a process that left no record"
    return (f"pid {record.get('pid')} on {record.get('host')}, started "
            f"{record.get('started', '?')}")


class RunLock:
    """The launcher's exclusive lock on a run directory (see the module docstring)."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.previous: dict = {}   # the record of a dead holder this lock was taken over from

    def acquire(self, workers_grace_s: float = 5.0) -> RunLock:
        key = f"trainer.run_dir={str(self.run_dir)!r}"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = _open(self.run_dir / LOCK_FILE)
        except OSError as err:
            raise RunDirError(f"{key} cannot be written ({err.strerror or err}); choose another "
                              "directory") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _record(fd)
            os.close(fd)
            raise RunDirError(f"{key} is in use by a live run ({_describe(holder)}); wait for "
                              "it to finish, stop it, or choose another trainer.run_dir") from None
        try:
            self._wait_for_old_workers(key, workers_grace_s)
        except BaseException:
            os.close(fd)   # closing drops the lock
            raise
        self.previous = _record(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self.fd = fd
        return self

    def _wait_for_old_workers(self, key: str, grace_s: float) -> None:
        """Workers of a dead launcher stop on their own within a second (runtime/watchdog.py);
        wait that long rather than share the directory with them."""
        path = self.run_dir / WORKERS_LOCK
        if not path.exists():
            return
        fd = _open(path)
        try:
            deadline = time.monotonic() + grace_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return   # closing fd below releases it for this run's workers
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RunDirError(
                            f"{key}: workers of an earlier run still hold it after "
                            f"{grace_s:.0f} s (see {self.run_dir / 'workers'}/rank*.pid); stop "
                            "them first") from None
                    time.sleep(0.05)
        finally:
            os.close(fd)

    def took_over(self) -> str:
        """A line for the log when the lock was left by a run that died ("" otherwise)."""
        if not self.previous or self.previous.get("pid") == os.getpid():
            return ""
        return (f"run directory lock: taken over from {_describe(self.previous)}, which is no "
                "longer running")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)   # a clean exit leaves no holder's record
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self.fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def announce_takeover(lock: RunLock) -> None:
    """Say (terminal and run log) that the lock was left by a run that died."""
    message = lock.took_over()
    if message:
        print(f"[dagrl] {message}", flush=True)
        append_run_log(lock.run_dir, message)


def hold_worker_lock(run_dir: Path | str) -> int:
    """A worker's shared lock on `<run_dir>/workers/lock`, held until the process ends (the
    returned descriptor is never closed on purpose)."""
    path = Path(run_dir) / WORKERS_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open(path)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd
