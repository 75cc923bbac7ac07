"""OS errors reach the error line with their cause and path (issue 38): a run directory on a
read-only file system or without write permission is refused by the pre-flight (nothing
written); a disk that fills up mid-run names the log it could not write (a failed write() has
no file name of its own). The full disk during a checkpoint save: tests/reliability/
test_full_disk.py.

The file systems are real: tmpfs mounts (read-only; small, then filled). Mounting needs root
(CAP_SYS_ADMIN); where it is not permitted those tests skip, saying so. Permission: as root
(who may write anywhere) the run starts without the capability that lets it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.helpers import (
    FAST,
    SMALL,
    assert_one_error_line,
    dagrl_cmd,
    env,
    wait_for,
)

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1   # linux/prctl.h, linux/capability.h


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, check=False)
    except OSError as err:
        pytest.skip(f"no mount(8) here: {err}")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Write `path` until the disk holds not one more byte."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)


def test_a_run_directory_on_a_read_only_file_system_is_refused_before_any_work(tmp_path):
    ro = tmp_path / "ro"
    with tmpfs(ro, "size=1m,ro"):
        proc = subprocess.run(dagrl_cmd("train", f"trainer.run_dir={ro / 'run'}", *SMALL),
                              capture_output=True, text=True, env=env(), timeout=120,
                              check=False)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert_one_error_line(proc, f"trainer.run_dir='{ro / 'run'}'",
                              "is on a read-only file system")
        assert not (ro / "run").exists()


def without_dac_override() -> None:
    """Root without CAP_DAC_OVERRIDE (dropped from the bounding set before exec): the file
    permissions bind it as they bind any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def test_a_run_directory_without_write_permission_is_refused_before_any_work(tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir(mode=0o555)
    if os.geteuid() == 0:
        try:
            subprocess.run(["true"], preexec_fn=without_dac_override, check=True)
        except (OSError, subprocess.SubprocessError) as err:
            pytest.skip(f"root here cannot give up CAP_DAC_OVERRIDE: {err}")
    proc = subprocess.run(dagrl_cmd("train", f"trainer.run_dir={parent / 'run'}", *SMALL),
                          capture_output=True, text=True, timeout=120, check=False, env=env(),
                          preexec_fn=without_dac_override if os.geteuid() == 0 else None)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert_one_error_line(proc, f"trainer.run_dir='{parent / 'run'}'",
                          f"'{parent}': permission denied")
    assert not (parent / "run").exists()


def test_a_disk_filling_up_mid_run_names_the_log_it_could_not_write(tmp_path):
    run_dir = tmp_path / "disk" / "run"
    with tmpfs(tmp_path / "disk", "size=8m"):
        proc = subprocess.Popen(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST,
                                          "data.train_batch_size=4", "actor.mini_batch_size=4",
                                          "rollout.n=2", "rollout.max_new_tokens=4",
                                          "trainer.total_steps=200"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env())
        try:
            metrics = run_dir / "metrics.jsonl"
            wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, 120,
                     "the first step's metrics")
            fill(tmp_path / "disk" / "filler")
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1, err[-2000:]
        done = subprocess.CompletedProcess([], 1, "", err)
        line = assert_one_error_line(done, "No space left on device", str(metrics))
        assert "Traceback" not in err, line
