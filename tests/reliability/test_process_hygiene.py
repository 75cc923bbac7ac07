"""No orphan workers, one live run per directory (issue 22, case 3; done-when 2).

Real processes, really killed: the Ray driver and the torchrun agent get SIGKILL (what the OOM
killer sends) in the middle of a run that checkpoints every step. Their workers must stop at
once — no file of the run directory changes more than 1 s after the kill — and no process the
run started may survive. A second `dagrl train` on a live run directory is refused; the lock of
a killed run is taken over.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.helpers import (
    FAST,
    ProcessTree,
    alive,
    assert_one_error_line,
    checkpoints,
    dagrl_cmd,
    env,
    kill9,
    newest_write,
    run,
    torchrun_cmd,
    wait_for,
    worker_pids,
)

LONG = [*FAST, "trainer.total_steps=100000", "trainer.save_every=1"]
LOCK_FILE = "run.lock"   # as dagrl.runtime.run_lock names it


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env())


def stop_leftovers(tree: ProcessTree, proc: subprocess.Popen) -> None:
    """After a failed assertion: end what this test started (only processes it saw start)."""
    for pid in [proc.pid, *tree.stop()]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def kill_mid_run_and_watch(cmd: list[str], run_dir: Path, log: Path) -> dict:
    """Start `cmd`, SIGKILL it once two checkpoints are written, measure its workers' end."""
    proc = start(cmd, log)
    tree = ProcessTree(proc.pid)
    try:
        wait_for(lambda: worker_pids(run_dir, 2) and len(checkpoints(run_dir)) >= 2, 240,
                 f"two checkpoints (log: {log})")
        workers = worker_pids(run_dir, 2)
        killed_at = kill9(proc.pid)
        proc.wait()
        wait_for(lambda: not any(alive(p) for p in workers), 30, "the workers to stop",
                 poll_s=0.01)
        stopped_s = time.time() - killed_at
        time.sleep(2.0)   # a worker still running would write its next checkpoint by now
        last_write_s = newest_write(run_dir) - killed_at
        wait_for(lambda: not tree.alive(), 30, "every process of the run to end")
        started = tree.stop()
        return {"stopped_s": stopped_s, "last_write_s": last_write_s, "processes": len(started)}
    except BaseException:
        stop_leftovers(tree, proc)
        raise


@pytest.mark.slow
def test_killed_ray_driver_stops_its_workers_and_ray(tmp_path):
    run_dir = tmp_path / "run"
    result = kill_mid_run_and_watch(
        dagrl_cmd("train", f"trainer.run_dir={run_dir}", "trainer.n_workers=2", *LONG),
        run_dir, tmp_path / "driver.log")
    print(f"ray driver kill -9: workers stopped after {result['stopped_s']:.3f} s, last write "
          f"{result['last_write_s']:.3f} s after the kill, {result['processes']} processes ended")
    assert result["last_write_s"] <= 1.0
    assert result["stopped_s"] <= 1.0
    assert result["processes"] >= 4       # Ray's GCS, raylet and agents, the two workers...
    # A relaunch right away takes the dead driver's lock over and resumes (here on 1 worker).
    newest = int(checkpoints(run_dir)[-1].split("_")[1])
    proc = run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST,
                         f"trainer.total_steps={newest + 1}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run directory lock: taken over from pid" in proc.stdout
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{newest:08d}'}" in proc.stdout


@pytest.mark.slow
def test_killed_torchrun_agent_stops_its_workers(tmp_path):
    run_dir = tmp_path / "run"
    result = kill_mid_run_and_watch(torchrun_cmd(f"trainer.run_dir={run_dir}", *LONG),
                                    run_dir, tmp_path / "torchrun.log")
    print(f"torchrun kill -9: workers stopped after {result['stopped_s']:.3f} s, last write "
          f"{result['last_write_s']:.3f} s after the kill")
    assert result["last_write_s"] <= 1.0
    assert result["stopped_s"] <= 1.0


@pytest.mark.slow
def test_second_run_on_a_live_directory_is_refused_and_a_dead_ones_lock_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    first = start(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *LONG),
                  tmp_path / "first.log")
    tree = ProcessTree(first.pid)
    try:
        wait_for(lambda: len(checkpoints(run_dir)) >= 1, 120, "the first run's checkpoint")
        config_before = (run_dir / "config.yaml").stat().st_mtime_ns
        second = run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST))
        assert second.returncode == 1
        assert_one_error_line(second, f"error: trainer.run_dir='{run_dir}' is in use by a "
                                      f"live run (pid {first.pid} on {socket.gethostname()}")
        # the same under torchrun: rank 0 is refused, rank 1 follows quietly
        second = run(torchrun_cmd(f"trainer.run_dir={run_dir}", *FAST))
        assert second.returncode != 0 and "[rank" not in second.stderr
        assert_one_error_line(second, f"is in use by a live run (pid {first.pid} on")
        assert (run_dir / "config.yaml").stat().st_mtime_ns == config_before
        log = run_dir / "dagrl.log"   # the live run's log: the refused run wrote nothing there
        assert not log.exists() or "rank 0 (pid" not in log.read_text()
        kill9(first.pid)
        first.wait()
        wait_for(lambda: not tree.alive(), 30, "the first run to end")
    finally:
        stop_leftovers(tree, first)
    newest = int(checkpoints(run_dir)[-1].split("_")[1])
    third = run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST,
                          f"trainer.total_steps={newest + 1}"))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"run directory lock: taken over from pid {first.pid} on" in third.stdout
    assert (run_dir / LOCK_FILE).read_text() == ""   # released cleanly: no holder recorded


@pytest.mark.slow
def test_sigterm_to_the_ray_driver_shuts_everything_down(tmp_path):
    run_dir = tmp_path / "run"
    driver = start(dagrl_cmd("train", f"trainer.run_dir={run_dir}", "trainer.n_workers=2",
                             *LONG), tmp_path / "driver.log")
    tree = ProcessTree(driver.pid)
    try:
        wait_for(lambda: len(checkpoints(run_dir)) >= 1, 240, "a checkpoint")
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 128 + signal.SIGTERM
        wait_for(lambda: not tree.alive(), 30, "every process of the run to end")
        assert (run_dir / LOCK_FILE).read_text() == ""   # the finally blocks ran
        log = (tmp_path / "driver.log").read_text()
        assert "error: stopped by SIGTERM" in log and "Traceback" not in log
    finally:
        stop_leftovers(tree, driver)


HOLD_SHARED = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(60)
"""


def test_lock_waits_for_the_workers_of_a_dead_launcher(tmp_path):
    """A stale run.lock is not enough: a worker of the old run still holding workers/lock
    (its shared flock) keeps the directory from being taken over."""
    from dagrl.runtime.run_dir import RunDirError
    from dagrl.runtime.run_lock import RunLock
    run_dir = tmp_path / "run"
    (run_dir / "workers").mkdir(parents=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone"}))
    worker = subprocess.Popen([sys.executable, "-c", HOLD_SHARED, str(run_dir / "workers" /
                                                                    "lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match="workers of an earlier run still hold it"):
            RunLock(run_dir).acquire(workers_grace_s=0.3)
        worker.kill()
        worker.wait()
        lock = RunLock(run_dir).acquire(workers_grace_s=0.3)
        assert "taken over from pid 999999 on gone" in lock.took_over()
        with pytest.raises(RunDirError, match=f"in use by a live run \\(pid {os.getpid()}"):
            RunLock(run_dir).acquire()
        lock.release()
    finally:
        worker.kill()
        worker.wait()


# The two watchdogs on their own, without Ray or torchrun: the module is loaded from its file,
# so each process starts in well under a second.
LOAD_WATCHDOG = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("watchdog", sys.argv[1])
watchdog = importlib.util.module_from_spec(spec)
spec.loader.exec_module(watchdog)
"""
DRIVER = LOAD_WATCHDOG + """
beacon = watchdog.DriverBeacon()
print(beacon.address[1], flush=True)
time.sleep(120)
"""
WORKER = LOAD_WATCHDOG + """
{watch}
print("watching", flush=True)
while True:                       # a worker writing to its run directory
    with open(sys.argv[2], "a") as f:
        f.write("x")
    time.sleep(0.005)
"""
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
print(child.pid, flush=True)
time.sleep(120)
"""


def watchdog_file() -> str:
    return str(Path(__file__).resolve().parents[2] / "dagrl" / "runtime" / "watchdog.py")


def wait_until_writing(path: Path) -> None:
    wait_for(lambda: path.exists() and path.stat().st_size > 10, 30, "the worker to write")


def test_driver_watchdog_ends_a_worker_when_its_driver_is_killed(tmp_path):
    out = tmp_path / "written"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, watchdog_file()],
                              stdout=subprocess.PIPE, text=True)
    port = driver.stdout.readline().strip()
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(
        watch=f"watchdog.watch_driver(('127.0.0.1', {port}))"), watchdog_file(), str(out)])
    try:
        wait_until_writing(out)
        killed_at = kill9(driver.pid)
        assert worker.wait(timeout=10) == 70              # ORPHANED_EXIT
        stopped_s = time.time() - killed_at
        print(f"driver watchdog: worker ended {stopped_s:.3f} s after kill -9")
        assert out.stat().st_mtime - killed_at <= 1.0 and stopped_s <= 1.0
    finally:
        for proc in (driver, worker):
            proc.kill()
            proc.wait()


def test_launcher_watchdog_ends_a_worker_when_its_launcher_is_killed(tmp_path):
    out = tmp_path / "written"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER,
                                 WORKER.format(watch="watchdog.watch_parent()"),
                                 watchdog_file(), str(out)], stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    try:
        wait_until_writing(out)
        killed_at = kill9(launcher.pid)
        launcher.wait()
        wait_for(lambda: not alive(worker), 10, "the worker to end", poll_s=0.01)
        stopped_s = time.time() - killed_at
        print(f"launcher watchdog: worker ended {stopped_s:.3f} s after kill -9")
        assert out.stat().st_mtime - killed_at <= 1.0 and stopped_s <= 1.0
    finally:
        launcher.kill()
        launcher.wait()
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
