"""Workers stop when whatever started them is gone.

A worker whose driver (Ray) or launcher (torchrun) died has nobody to report to, and every
step it still runs writes checkpoints and metrics into a directory a relaunch may already be
using. So each worker runs a watchdog thread that ends the process at once — `os._exit`, no
cleanup, no checkpoint — when:

- under Ray: the connection it opened to the driver's `DriverBeacon` closes. The kernel closes
  it when the driver process ends, however it ends (kill -9 included), so the worker's blocked
  `recv` returns within milliseconds, on any host. (A driver done with its workers sends one
  byte first: they end quietly, while the driver kills them anyway);
- under torchrun: its parent process (the torchrun agent) changes, which is what happens the
  moment the agent dies (the worker is re-parented).

Exit status 70 (EX_SOFTWARE) tells a supervisor the worker was orphaned, not that it failed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

ORPHANED_EXIT = 70
QUIET = b"q"   # the driver's "we are done": no message, no failure


_watched_parent: int | None = None
_driver_gone = threading.Event()


def orphaned() -> bool:
    """True once this worker's launcher or driver is gone. A rank whose peer was just stopped by
    its watchdog sees a collective fail before its own watchdog fires: such an error is a
    consequence, not worth a report (nobody is left to read it)."""
    return _driver_gone.is_set() or (_watched_parent is not None
                                     and os.getppid() != _watched_parent)


def _stop(reason: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"[dagrl] worker pid {os.getpid()}: {reason}; stopping\n".encode())
    os._exit(ORPHANED_EXIT)


def watch_parent(poll_s: float = 0.1) -> None:
    """torchrun: end this process within `poll_s` of its launcher's death."""
    global _watched_parent
    parent = os.getppid()
    if parent <= 1:   # already an orphan, or started by init: nothing to watch
        return
    _watched_parent = parent

    def loop() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                _stop(f"its launcher (pid {parent}) died")

    threading.Thread(target=loop, name="dagrl-watch-launcher", daemon=True).start()


class DriverBeacon:
    """The driver's end: a listening socket the workers connect to and read from forever."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._server = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        self._conns: list[socket.socket] = []   # kept open: closing one stops its worker
        self._closed = False
        threading.Thread(target=self._accept, name="dagrl-driver-beacon", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)

    def close(self) -> None:
        """The run is over: workers still alive end quietly (the driver is not dying)."""
        self._closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.sendall(QUIET)
        for s in [self._server, *self._conns]:
            with contextlib.suppress(OSError):
                s.close()


def watch_driver(address: tuple[str, int], connect_timeout_s: float = 30.0) -> None:
    """Ray worker: connect to the driver's beacon and end this process when it closes."""
    conn = socket.create_connection(address, timeout=connect_timeout_s)
    conn.settimeout(None)
    # A driver host that vanishes without closing the connection is noticed by keepalives.
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def loop() -> None:
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        _driver_gone.set()
        if data == QUIET:
            os._exit(0)
        _stop("its driver process ended")

    threading.Thread(target=loop, name="dagrl-watch-driver", daemon=True).start()
