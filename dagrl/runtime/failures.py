"""How a failed run is reported: one line on the terminal, the traceback in the run's log.

Whatever failed — a bad input found by the pre-flight, a worker raising at step 40, a worker
killed — the user sees one line naming the cause (`error: ...`), plus a `hint:` line saying
where the traceback went when there is one. With several workers only the *first* failing
rank's error is shown: the others usually fail because of it (a peer's socket closed under a
collective), and their messages would bury the cause. Ranks agree on who was first through the
process group's key-value store (`claim_first_failure`). `--debug` prints tracebacks instead.

A `Failure` is the picklable record of one rank's error; Ray workers return it to the driver
instead of raising (so Ray prints no remote traceback of its own), torchrun workers print it
and write it to torchrun's error file (so torchrun's summary names the cause too).

Ctrl-C is no failure: status 130 and one line saying where the run stopped and which checkpoint
the same command resumes from (`interrupts_once`, `interrupted_line`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TextIO

RUN_LOG = "dagrl.log"
# The machine's refusals (full disk or quota, read-only file system, permission, file too
# large): no bug of dagrl's; the error's cause and path are the whole story.
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                            errno.EFBIG})
INTERRUPTED_EXIT = 130   # the shell's status for a program ended by SIGINT (128 + 2)
MAX_LINE = 600


class PeerFailed(RuntimeError):
    """This rank stopped because another rank failed first (its error is the one reported)."""


# Errors caused by the input (config, graph, data, model directory, checkpoints, reward
# function, run directory): their message is the whole story, a traceback adds nothing.
USER_ERRORS = {
    "dagrl.config.loader": "ConfigError",
    "dagrl.dag.spec": "GraphError",
    "dagrl.data.errors": "DatasetError",
    "dagrl.engines.models": "TokenizerError",
    "dagrl.extras": "MissingExtraError",
    "dagrl.registry": "UnknownNameError",
    "dagrl.rewards.manager": "RewardError",
    "dagrl.rollout.server": "ServerError",
    "dagrl.runtime.checkpoint": "CheckpointError",
    "dagrl.runtime.placement": "PlacementError",
    "dagrl.runtime.run_dir": "RunDirError",
}


def user_error_types() -> tuple[type[BaseException], ...]:
    """The classes of USER_ERRORS, and a missing file or a non-finite number. Only modules
    already imported are read: an error cannot be of a class never loaded, and reporting a
    refused input must not load torch and transformers to find that out."""
    loaded = [getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS.items()]
    return (*(cls for cls in loaded if cls is not None), FileNotFoundError, FloatingPointError)


def one_line(text: str) -> str:
    """The first line of a message, shortened: what fits on a terminal line."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if len(lines) > 1:
        first += " ..."
    return first if len(first) <= MAX_LINE else first[:MAX_LINE - 3] + "..."


@dataclass
class Failure:
    """One rank's error, as the launcher reports it."""
    rank: int | None        # None: the launching process itself (pre-flight, single worker)
    kind: str               # the exception's type name
    message: str
    traceback: str
    user: bool              # a user error (bad input): no bug, no crash
    first: bool = True      # the first rank to fail (see claim_first_failure)
    cause_rank: int | None = None   # when not first: the rank that failed first
    secondary: bool = False  # stopped because a peer failed (PeerFailed)

    @classmethod
    def of(cls, err: BaseException, rank: int | None = None, first: bool = True) -> Failure:
        if isinstance(err, KeyboardInterrupt):
            return cls(rank, "KeyboardInterrupt", "interrupted", "", True, first)
        user = isinstance(err, user_error_types()) or (
            isinstance(err, OSError) and err.errno in MACHINE_ERRNOS)
        return cls(rank, type(err).__name__, str(err),
                   "".join(traceback.format_exception(type(err), err, err.__traceback__)),
                   user, first, isinstance(err, PeerFailed))

    def line(self) -> str:
        """`error: [rank r: ]message`; a bug's line also names the exception's type (a user
        error's message says what is wrong, the type adds nothing)."""
        where = f"rank {self.rank}: " if self.rank is not None else ""
        kind = "" if self.user else f"{self.kind}: "
        after = (f" (after rank {self.cause_rank} failed)" if self.rank is not None
                 and not self.first and self.cause_rank is not None else "")
        return f"error: {where}{kind}{one_line(self.message)}{after}"


class WorkerFailed(RuntimeError):
    """A worker process raised or died; `failure` is the first failing rank's record."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__(f"worker rank {failure.rank} failed: {failure.kind}: "
                         f"{one_line(failure.message)}")


def run_log_path(run_dir: Path | str | None) -> Path | None:
    """`<run_dir>/dagrl.log` when the run directory exists (a refused run has none)."""
    if not run_dir or not Path(run_dir).is_dir():
        return None
    return Path(run_dir) / RUN_LOG


def append_run_log(run_dir: Path | str | None, text: str) -> Path | None:
    """Append `text` to the run's log; returns the log's path (None: no run directory yet, or
    it cannot be written — the terminal line still says what happened)."""
    path = run_log_path(run_dir)
    if path is None:
        return None
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{stamp} {text.rstrip()}\n")
    except OSError:
        return None
    return path


def log_failure(run_dir: Path | str | None, failure: Failure) -> Path | None:
    """Write the failure's traceback to the run log (one block per rank)."""
    who = f"rank {failure.rank}" if failure.rank is not None else "launcher"
    body = failure.traceback or f"{failure.kind}: {failure.message}"
    return append_run_log(run_dir, f"{who} (pid {os.getpid()} on {socket.gethostname()}) "
                                   f"failed:\n{body}")


def report(failure: Failure, log: Path | None, debug: bool, stream: TextIO | None = None) -> None:
    """Print the failure for the user: one line, then a hint or (with --debug) the traceback."""
    stream = stream or sys.stderr
    print(failure.line(), file=stream)
    if debug and failure.traceback:
        print(failure.traceback.rstrip(), file=stream)
    elif log is not None and failure.traceback:
        print(f"hint: the traceback is in {log} (--debug prints it here)", file=stream)
    stream.flush()


def claim_first_failure(rank: int, timeout_s: float = 2.0) -> int | None:
    """The rank that failed first, as agreed through the process group's store: every failing
    rank calls this, the first to increment the counter records its rank. Without a group, or
    when the store is gone with the rank that hosted it, None: each rank then counts itself as
    first (better two lines than none)."""
    try:
        store = _store(timeout_s)
        if store is None:
            return None
        if store.add("dagrl/failed_ranks", 1) == 1:
            store.set("dagrl/first_failed_rank", str(rank))
            return rank
        return int(store.get("dagrl/first_failed_rank"))
    except Exception:   # noqa: BLE001 — reporting must never fail
        return None


def _store(timeout_s: float):
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def mark_reported() -> None:
    """The first failing rank has printed its error (see wait_reported)."""
    with contextlib.suppress(Exception):
        store = _store(2.0)
        if store is not None:
            store.set("dagrl/reported", "1")


def wait_reported(timeout_s: float = 5.0) -> None:
    """A rank that did not fail first waits (a little) for the first one to have printed:
    torchrun stops every worker as soon as one exits, which could cut the reporter off."""
    with contextlib.suppress(Exception):
        store = _store(timeout_s)
        if store is not None:
            store.wait(["dagrl/reported"], timedelta(seconds=timeout_s))


def write_elastic_error_file(failure: Failure, log: Path | None) -> None:
    """torchrun's summary of a failed worker shows this file (TORCHELASTIC_ERROR_FILE) in place
    of its link to the docs: our one line and where the traceback is."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    shown = failure.line() + (f" (traceback: {log})" if log else "")
    # torchrun calls the failure with the smallest timestamp (whole seconds) the root cause; a
    # rank that failed because another did sorts after it, so the summary names the cause.
    stamp = int(time.time()) + (0 if failure.first else 1)
    data = {"message": {"message": shown, "extraInfo": {"py_callstack": shown,
                                                        "timestamp": str(stamp)}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass


class Terminated(SystemExit):
    """SIGTERM reached the launching process: it unwinds like an exit (status 128 + 15), so
    Ray is shut down and the run lock released on the way out."""


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While inside: SIGTERM raises `Terminated` in the main thread. Code that turns the
    exception into one of its own on the way (Ray's `wait` raises SystemExit(1) when a signal
    handler raises inside it) is overruled: what leaves the block is `Terminated`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except BaseException as err:
        if received and not isinstance(err, Terminated):
            raise Terminated(128 + received[0]) from err
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Sigint:
    """Ctrl-C's state in this process (see `interrupts_once`)."""
    received = False   # a SIGINT arrived
    pending = False    # ... while a checkpoint was being written: raised once it is
    deferring = 0      # depth of `interrupts_deferred` blocks


def _on_sigint(signum, frame) -> None:
    if _Sigint.received:   # torchrun's agent passes on the signal the terminal already sent
        return
    _Sigint.received = True
    if _Sigint.deferring:
        _Sigint.pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_once() -> Iterator[None]:
    """While inside: the first SIGINT raises KeyboardInterrupt in the main thread (or, inside
    `interrupts_deferred`, when that block ends); later ones are ignored, so they cannot cut
    short the reporting of the first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Sigint.received = _Sigint.pending = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def was_interrupted(err: BaseException) -> bool:
    """Whether `err` is Ctrl-C's doing: the KeyboardInterrupt itself, or what a collective
    raised when a peer left for it (every rank of the terminal's process group got SIGINT)."""
    return isinstance(err, KeyboardInterrupt) or _Sigint.received


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A checkpoint being written is finished before Ctrl-C stops the run: the checkpoint the
    interrupted line names is then whole (its write is atomic either way)."""
    _Sigint.deferring += 1
    try:
        yield
    finally:
        _Sigint.deferring -= 1
        if _Sigint.pending and not _Sigint.deferring:
            _Sigint.pending = False
            raise KeyboardInterrupt


def interrupted_line(run_dir: Path | str | None, checkpoint_dir: str = "") -> str:
    """Ctrl-C's one line: the step the run stopped in (the one after the last logged) and the
    checkpoint the same command resumes from."""
    from dagrl.observe.run_files import read_jsonl
    from dagrl.runtime.checkpoint import list_checkpoints

    if not run_dir or not Path(run_dir).is_dir():
        return "interrupted before the run started; nothing was written"
    metrics = Path(run_dir) / "metrics.jsonl"
    steps = [r["step"] for r in read_jsonl(metrics).records
             if isinstance(r.get("step"), int)] if metrics.is_file() else []
    found = list_checkpoints(Path(checkpoint_dir or Path(run_dir) / "checkpoints"))
    last = (f"the last checkpoint is {found[-1][1]} (the same command resumes from it)"
            if found else "no checkpoint was written yet (trainer.save_every=N writes one "
                          "every N steps)")
    return f"interrupted at step {max(steps, default=0) + 1}; {last}"
