"""The body of every distributed worker process (a torchrun process or a Ray actor): join the
process group the environment describes, let rank 0 prepare the run directory, train.

Under torchrun there is no dagrl driver, so `torchrun_main` does the driver's share too: the
input checks (every rank, before anything is written), the run-directory lock (rank 0), the
watch on the launcher, and reporting: only the first failing rank prints its error, and the
others wait until it has (torchrun stops every worker as soon as one exits).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dagrl.config.loader import from_dict, to_dict
from dagrl.config.schema import Config
from dagrl.runtime.distributed import DistContext, init_distributed, shutdown
from dagrl.runtime.failures import (
    INTERRUPTED_EXIT,
    Failure,
    PeerFailed,
    append_run_log,
    claim_first_failure,
    interrupted_line,
    interrupts_once,
    log_failure,
    mark_reported,
    report,
    wait_reported,
    was_interrupted,
    write_elastic_error_file,
)
from dagrl.runtime.input_checks import check_inputs
from dagrl.runtime.reaper import proc_stat
from dagrl.runtime.run_dir import (
    announce_run_dir,
    prepare_run,
    resolve_run_dir,
    with_run_dir,
    write_pid_file,
)
from dagrl.runtime.run_lock import RunLock, announce_takeover, hold_worker_lock
from dagrl.runtime.watchdog import ORPHANED_EXIT, orphaned, watch_parent
from dagrl.runtime.worker import Worker

_START_TIME = time.time()   # this process's start, near enough (module import)


@dataclass
class WorkerState:
    """What the reporting of a worker's failure needs to know about how far it got."""
    rank: int = 0
    run_dir: Path | None = None
    first: bool = True      # this rank's failure was the first in the group
    cause_rank: int | None = None   # the rank that failed first, when known

    def claim(self, err: BaseException) -> None:
        """After `err`, while the group's store is up: was this rank the first to fail?"""
        peer = isinstance(err, PeerFailed)
        self.cause_rank = None if peer else claim_first_failure(self.rank)
        self.first = not peer and self.cause_rank in (None, self.rank)


def run_worker(cfg: Config, ctx: DistContext, state: WorkerState,
               take_lock: bool = False) -> list[dict[str, float]]:
    """Let rank 0 prepare the run (taking the run-directory lock when `take_lock`: under
    torchrun, where no driver holds it), then train. Returns the per-step metrics (the same on
    every rank)."""
    lock: RunLock | None = None
    worker_lock: int | None = None
    try:
        if ctx.world_size != cfg.trainer.n_workers:
            # The launcher's world size wins (torchrun --nproc-per-node); re-check the config.
            data = to_dict(cfg)
            data["trainer"]["n_workers"] = ctx.world_size
            cfg = from_dict(Config, data)
        # Rank 0 prepares the run; if that fails, the others learn it here instead of waiting
        # on a broadcast that never comes (and stay quiet: rank 0's error is the one shown).
        resolved, error = None, None
        if ctx.rank == 0:
            try:
                cfg = with_run_dir(cfg, resolve_run_dir(cfg))   # a default name is timed: once
                run_dir = Path(cfg.trainer.run_dir)
                if take_lock:   # refused: the directory is another run's, leave its log alone
                    lock = RunLock(run_dir).acquire()
                    announce_takeover(lock)
                state.run_dir = run_dir
                if take_lock:   # torchrun: no driver says it
                    announce_run_dir(run_dir)
                resolved = prepare_run(cfg)
            except Exception as err:   # noqa: BLE001 — re-raised below, after the broadcast
                error = err
        resolved = ctx.broadcast_object(resolved)
        if error is not None:
            raise error
        if resolved is None:
            raise PeerFailed("rank 0 could not prepare the run directory")
        state.run_dir = Path(resolved.trainer.run_dir)
        worker_lock = hold_worker_lock(state.run_dir)
        write_pid_file(state.run_dir, ctx.rank)
        history = Worker(resolved, ctx).train()   # sync or async: one loop (runtime/sides.py)
        # Every rank finishes its last collective before any rank tears its connections down:
        # a rank destroying its group while a peer still talks to it can abort the peer (seen
        # once under torchrun as `terminate called without an active exception` at exit).
        # Only on success: after a failure the peers may never reach a barrier.
        ctx.barrier()
        return history
    finally:
        if worker_lock is not None:
            os.close(worker_lock)
        if lock is not None:
            lock.release()


def run_worker_from_env(cfg: Config, state: WorkerState | None = None) -> list[dict[str, float]]:
    """A Ray actor's body: join the group the environment describes, run, leave the group. On
    failure `state` says whether this rank failed first."""
    state = state or WorkerState()
    ctx = init_distributed(cfg.trainer.device, host_tensors=cfg.host_tensors_in_collectives)
    state.rank = ctx.rank
    try:
        return run_worker(cfg, ctx, state)
    except BaseException as err:
        state.claim(err)
        raise
    finally:
        shutdown()


def peer_died(run_dir: Path, rank: int) -> bool:
    """Whether another rank of this run is no longer alive (its pid file, written when it
    started, names a process that is gone; files older than this process are an earlier
    run's)."""
    started = _START_TIME
    for path in (run_dir / "workers").glob("rank*.pid"):
        try:
            if path.name == f"rank{rank}.pid" or path.stat().st_mtime < started:
                continue
            pid = int(path.read_text())
        except (OSError, ValueError):
            continue
        if proc_stat(pid) is None:
            return True
    return False


# A peer killed by a signal closes its sockets before its process is gone from /proc: the
# window in which a survivor, failing on the reset socket, still sees it alive (seen once under
# load: both lines printed).
PEER_DEATH_GRACE_S = 1.0


def peer_died_soon(run_dir: Path, rank: int, within_s: float = PEER_DEATH_GRACE_S) -> bool:
    """`peer_died`, asked again every 50 ms for `within_s` while other ranks' pid files exist."""
    deadline = time.monotonic() + within_s
    while True:
        if peer_died(run_dir, rank):
            return True
        if time.monotonic() >= deadline or not any(
                p.name != f"rank{rank}.pid" for p in (run_dir / "workers").glob("rank*.pid")):
            return False
        time.sleep(0.05)


def torchrun_main(cfg: Config, debug: bool) -> int:
    """One torchrun process, start to end; returns its exit status. Errors: one line, from the
    first failing rank only; every rank's traceback goes to the run log. Ctrl-C: rank 0 says
    where the run stopped (every rank of the terminal's process group got the signal)."""
    watch_parent()   # torchrun killed -> this worker stops within 0.1 s
    state = WorkerState(int(os.environ["RANK"]))
    checked = False
    try:
        with interrupts_once():
            # The group first (it writes nothing): the ranks agree through it on who reports.
            ctx = init_distributed(cfg.trainer.device,
                                   host_tensors=cfg.host_tensors_in_collectives)
            # Gloo can return on rank 0 while rank 1 still connects its half of the mesh: a
            # rank 0 refusing a bad input then exits under it, and rank 1's "connection closed"
            # (raised before the group exists, so it cannot learn it was not first) printed a
            # traceback beside the real error (seen once in CI). Every rank is in the group
            # after this.
            ctx.barrier()
            check_inputs(cfg)   # every rank: the same answer, before anything is written
            checked = True
            run_worker(cfg, ctx, state, take_lock=True)
        if state.rank == 0 and state.run_dir is not None:
            announce_run_dir(state.run_dir, finished=True)
        return 0
    except BaseException as err:   # noqa: BLE001 — reported, then the process exits
        if orphaned():   # torchrun is gone: this error is the fallout, and nobody listens
            return ORPHANED_EXIT
        if was_interrupted(err):
            if state.rank == 0:
                line = interrupted_line(state.run_dir, cfg.trainer.checkpoint_dir)
                print(line, file=sys.stderr, flush=True)
                append_run_log(state.run_dir, line)
            return INTERRUPTED_EXIT
        return _report_failure(err, state, checked, debug)
    finally:
        shutdown()


def _report_failure(err: BaseException, state: WorkerState, checked: bool, debug: bool) -> int:
    """Log this rank's failure and print it if it came first; its exit status."""
    state.claim(err)
    # An input refused by the checks is the same on every rank: no rank label.
    failure = Failure.of(err, state.rank if checked else None, first=state.first)
    failure.cause_rank = state.cause_rank
    if failure.first and state.run_dir is not None and peer_died_soon(state.run_dir, state.rank):
        # A peer killed by a signal (kill -9, the OOM killer) says nothing; this rank's error
        # (a socket reset under a collective) is the consequence: the launcher names the death.
        failure.secondary = True
    log = log_failure(state.run_dir, failure)
    write_elastic_error_file(failure, log)
    if failure.first and not failure.secondary:
        # A bug (not a user error) with nowhere to log it: the traceback is all there is.
        report(failure, log, debug or (log is None and not failure.user))
        mark_reported()
    else:
        if debug:
            print(failure.line(), file=sys.stderr)
        wait_reported()   # exiting first would let torchrun kill the reporter mid-line
    return 1
