"""A disk that fills up during a save (issue 38): the error line carries the OS's cause and the
file it could not write (not DCP's "CheckpointException ranks:dict_keys([0])"), nothing is
committed, and the run exits with one line.

The full disk is real: a 512 KiB tmpfs mounted as the checkpoint directory (the checkpoint of
the tiny model is ~1.8 MB). Where mounting is not permitted, a file-size limit on the process
(RLIMIT_FSIZE, "File too large") stands in: the same write fails with another OS error, and the
line must carry that one."""

from __future__ import annotations

import contextlib
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.reliability.helpers import FAST, assert_one_error_line, dagrl_cmd, env

LIMIT = 512 * 1024


@contextlib.contextmanager
def small_disk(path: Path) -> Iterator[bool]:
    """A LIMIT-sized tmpfs at `path`; yields whether it could be mounted."""
    path.mkdir(parents=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={LIMIT // 1024}k",
                                  "tmpfs", str(path)], capture_output=True,
                                 check=False).returncode == 0
    except OSError:   # no mount(8) here
        mounted = False
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, 1024 * 1024))


def test_a_full_disk_during_a_save_names_the_cause_and_the_file(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    with small_disk(checkpoints) as mounted:
        cmd = dagrl_cmd("train", f"trainer.run_dir={tmp_path / 'run'}", *FAST,
                        "trainer.total_steps=1", "trainer.save_every=1",
                        f"trainer.checkpoint_dir={checkpoints}")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env(),
                              check=False, preexec_fn=None if mounted else limit_file_size)
        cause = "No space left on device" if mounted else "File too large"
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = assert_one_error_line(proc, "writing checkpoint", cause,
                                     str(checkpoints / ".tmp-step_00000001"),
                                     "nothing was committed")
        assert "CheckpointException" not in line and "Traceback" not in proc.stderr
        assert not list(checkpoints.glob("step_*")) and not list(checkpoints.glob(".tmp-*"))
