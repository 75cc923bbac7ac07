"""Ctrl-C and kill -9 as an operator meets them (issue 38): Ctrl-C ends a run with status 130
and one line saying where it stopped and which checkpoint the same command resumes from (a
checkpoint being written is finished first); under `dagrl train --nproc-per-node 2` the same
line, no launcher traceback, no process left; a worker killed by a signal is one line too.

Ctrl-C is the terminal's SIGINT to its whole foreground process group: the tests start the run
in a session of its own and signal the group, as the terminal would."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from dagrl.runtime.run_lock import RunLock
from tests.reliability.helpers import (
    FAST,
    ProcessTree,
    alive,
    checkpoints,
    dagrl_cmd,
    dagrl_torchrun_cmd,
    env,
    wait_for,
    worker_pids,
)

# Small steps, a checkpoint after each; LONG: enough of them that the interrupt lands mid-run.
STEPS = [*FAST, "data.train_batch_size=4", "actor.mini_batch_size=4", "rollout.n=2",
         "rollout.max_new_tokens=4", "trainer.save_every=1"]
LONG = [*STEPS, "trainer.total_steps=500"]
INTERRUPTED = re.compile(r"^interrupted at step (\d+); the last checkpoint is (\S+) "
                         r"\(the same command resumes from it\)$")


def start(cmd: list[str]) -> tuple[subprocess.Popen, ProcessTree]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), start_new_session=True)
    return proc, ProcessTree(proc.pid)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def assert_interrupted(proc: subprocess.Popen, err: str, run_dir) -> int:
    """Status 130, the one line (and nothing else on stderr), naming the newest checkpoint;
    returns the step it names."""
    assert proc.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    match = INTERRUPTED.match(lines[0])
    assert match, lines[0]
    newest = checkpoints(run_dir)[-1]
    assert match.group(2) == str(run_dir / "checkpoints" / newest)
    assert int(match.group(1)) == int(newest.removeprefix("step_")) + 1
    assert not list((run_dir / "checkpoints").glob(".*")), "a temporary checkpoint was left"
    RunLock(run_dir).acquire(workers_grace_s=0).release()   # the run's locks are free again
    return int(match.group(1))


def test_ctrl_c_is_status_130_and_names_the_checkpoint_to_resume_from(tmp_path):
    run_dir = tmp_path / "run"
    proc, tree = start(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *LONG))
    wait_for(lambda: len(checkpoints(run_dir)) >= 2, 120, "two checkpoints")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = finish(proc)
    step = assert_interrupted(proc, err, run_dir)
    assert f"interrupted at step {step}" in (run_dir / "dagrl.log").read_text()
    assert not [p for p in tree.stop() if alive(p)]
    # The same command goes on from that checkpoint.
    again = subprocess.run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *STEPS,
                                     f"trainer.total_steps={step}"),
                           capture_output=True, text=True, env=env(), timeout=120, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"step {step - 1}" in again.stdout and "resumed from" in again.stdout


def test_ctrl_c_under_dagrls_torchrun_is_one_line_and_stops_every_worker(tmp_path):
    run_dir = tmp_path / "run"
    proc, tree = start(dagrl_torchrun_cmd(f"trainer.run_dir={run_dir}", *LONG))
    wait_for(lambda: len(checkpoints(run_dir)) >= 2, 180, "two checkpoints")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = finish(proc)
    assert_interrupted(proc, err, run_dir)
    time.sleep(0.5)
    assert not [p for p in tree.stop() if alive(p)]


def test_a_worker_killed_by_a_signal_is_one_line_under_dagrls_torchrun(tmp_path):
    run_dir = tmp_path / "run"
    proc, tree = start(dagrl_torchrun_cmd(f"trainer.run_dir={run_dir}", *LONG))
    pids = wait_for(lambda: worker_pids(run_dir, 2), 120, "the workers' pid files")
    wait_for(lambda: checkpoints(run_dir), 120, "a checkpoint")
    os.kill(pids[1], signal.SIGKILL)
    _, err = finish(proc)
    assert proc.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: rank 1 (pid {pids[1]}) was killed by SIGKILL"), lines
    assert not [p for p in tree.stop() if alive(p)]
