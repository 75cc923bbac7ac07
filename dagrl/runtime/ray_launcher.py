"""Start N workers as Ray actors, one per placement-group bundle (one device each).

The driver holds no sample data: it reserves the bundles (at most
`trainer.placement_timeout_s`, then an error naming the missing resources), starts the actors,
gives each its environment from where Ray placed it (runtime/ray_worker.py: rank, LOCAL_RANK per
node, visible devices) and waits. A worker does not raise into Ray: it returns a `Failure`
record (so Ray prints no remote traceback), and the driver raises `WorkerFailed` with the first
failing rank's record; the other workers are stopped. With `trainer.max_restarts` > 0 a
failure that is not a user error (a worker killed, a crash) restarts all workers from the
newest checkpoint (`trainer.resume=auto`); a user error would only fail again. Each worker
watches the driver (runtime/watchdog.py) and stops at once if it dies. `RAY_ADDRESS` set: join
that cluster; otherwise start a local Ray instance (runtime/ray_session.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from dagrl.config.loader import to_dict
from dagrl.config.schema import Config
from dagrl.device import ray_device_type
from dagrl.observe.loggers import MetricsFileConsole
from dagrl.runtime.checkpoint import latest_checkpoint
from dagrl.runtime.failures import Failure, WorkerFailed, log_failure
from dagrl.runtime.ray_session import ray_session
from dagrl.runtime.ray_worker import start_workers
from dagrl.runtime.watchdog import DriverBeacon

# After a failure that may be a consequence (a peer's socket closed), how long to wait for the
# record of the rank that failed first, or for Ray to report a worker process dead.
CAUSE_GRACE_S = 3.0
# How often the driver draws the steps rank 0 logged (MetricsFileConsole).
CONSOLE_POLL_S = 0.5


def launch_ray(cfg: Config) -> list[dict[str, float]]:
    """Run the workers; restart them all from the last checkpoint after a failure, at most
    trainer.max_restarts times. Returns rank 0's metrics of the last attempt. `cfg` has its
    run directory resolved (every attempt must use the same one, and so the same checkpoints)."""
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    with ray_session(t.n_workers):
        restarts = 0
        while True:
            try:
                return _run_workers(cfg)
            except WorkerFailed as err:
                if restarts == t.max_restarts or err.failure.user:
                    raise
                restarts += 1
                last = latest_checkpoint(Path(t.checkpoint_dir or run_dir / "checkpoints"))
                print(f"[dagrl] {err}\n[dagrl] restart {restarts}/{t.max_restarts}: "
                      f"starting all {t.n_workers} workers again from "
                      f"{last or 'the beginning (no checkpoint yet)'}", flush=True)
                if t.resume != "auto":   # continue from what this run wrote, not the start
                    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
                        cfg.trainer, resume="auto"))


def _died(rank: int, err: BaseException, run_dir: str) -> Failure:
    """The record of a worker that ended without returning one (killed, out of memory)."""
    failure = Failure(rank, "WorkerDied", "the worker process died (killed by a signal, or out "
                      "of memory?); Ray's logs: /tmp/ray/session_latest/logs",
                      f"{type(err).__name__}: {err}", user=False)
    log_failure(run_dir, failure)
    return failure


def _cause(failures: list[Failure]) -> Failure:
    """The failure to report: a rank's own user error, else a death (the others then fail on
    its closed sockets), else the first rank to fail, else the first record received."""
    for wanted in (lambda f: f.user and f.first and not f.secondary,
                   lambda f: f.kind == "WorkerDied",
                   lambda f: f.first and not f.secondary):
        for f in failures:
            if wanted(f):
                return f
    return failures[0]


def _run_workers(cfg: Config) -> list[dict[str, float]]:
    """One attempt: a placement group, one actor per rank, wait for all; WorkerFailed if any
    fails or dies (the others are killed: they would wait forever on the failed one)."""
    import ray

    t = cfg.trainer
    n = t.n_workers
    # The cluster's accelerator, not the driver's: the driver may sit on a CPU-only head node.
    kind = ray_device_type(t.device, ray.cluster_resources())
    host = ray.util.get_node_ip_address() if os.environ.get("RAY_ADDRESS") else "127.0.0.1"
    beacon = DriverBeacon(host)
    try:
        workers = start_workers(kind, n, t.placement_strategy, t.placement_timeout_s)
    except BaseException:
        beacon.close()
        raise
    print(f"[dagrl] {workers.describe()}", flush=True)
    cfg_dict = to_dict(cfg)
    cfg_dict["trainer"]["device"] = kind   # every worker uses what the driver reserved
    console = _driver_console(cfg, cfg_dict, workers)
    try:
        messages = str(console.messages.path) if console is not None else None
        pending = {workers.actors[r].run.remote(cfg_dict, beacon.address, messages): r
                   for r in range(n)}
        results: dict[int, list] = {}
        failures: list[Failure] = []
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if console is not None:   # wake up to draw the steps rank 0 logged
                timeout = CONSOLE_POLL_S if timeout is None else min(timeout, CONSOLE_POLL_S)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if console is not None:
                console.poll()
            if not done:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                continue
            rank = pending.pop(done[0])
            try:
                status, value = ray.get(done[0])
            except ray.exceptions.RayActorError as err:   # the process is gone
                status, value = "failed", _died(rank, err, t.run_dir)
            except Exception as err:   # noqa: BLE001 — Ray itself failed the call
                status, value = "failed", Failure.of(err, rank)
            if status == "ok":
                results[rank] = value
                continue
            failures.append(value)
            if value.user and value.first and not value.secondary:
                break   # the cause itself: no need to wait for the consequences
            deadline = deadline or time.monotonic() + CAUSE_GRACE_S
        if failures:
            raise WorkerFailed(_cause(failures))
        return results[0]
    finally:
        if console is not None:
            console.close()
            console.messages.path.unlink(missing_ok=True)
        workers.stop()
        beacon.close()


def _driver_console(cfg: Config, cfg_dict: dict, workers) -> MetricsFileConsole | None:
    """With every worker on the driver's node, the driver draws the console from the metrics
    file the lead worker writes, and the workers print no bar or step lines of their own (Ray
    would forward each redraw of a worker's bar as a line of its own, prefixed), and the lines
    the workers print, which they write to a file the driver names. Across nodes the files may
    be on another machine: the workers keep their console."""
    import tempfile

    import ray

    here = ray.get_runtime_context().get_node_id()
    if "console" not in cfg.logging.backends or \
            any(p["node_id"] != here for p in workers.placements):
        return None
    logging_cfg = cfg_dict["logging"]
    logging_cfg["backends"] = [b for b in logging_cfg["backends"] if b != "console"]
    logging_cfg["progress_bar"] = False
    fd, messages = tempfile.mkstemp(prefix="dagrl-console-", suffix=".log")
    os.close(fd)
    return MetricsFileConsole(Path(cfg.trainer.run_dir) / "metrics.jsonl", cfg.logging,
                              cfg.trainer.total_steps, messages=Path(messages))
