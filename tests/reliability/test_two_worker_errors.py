"""With 2 workers, under Ray and under torchrun, an error is one line naming its cause, not a
pile of tracebacks (issue 22, case 5; done-when 3). The first failing rank's error is the one
shown; the traceback goes to `<run_dir>/dagrl.log`.

Under `torchrun`, torchrun itself then prints its own failure summary (its own traceback
included: it raises ChildFailedError in its own process, which no worker can prevent); the
workers make it name the same cause (its "Root Cause" entry shows dagrl's line). Under
`dagrl train --nproc-per-node 2` (the same agent, run by dagrl) the line is the whole output.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.reliability.helpers import (
    SMALL,
    ProcessTree,
    alive,
    arith_rows,
    assert_one_error_line,
    dagrl_cmd,
    dagrl_torchrun_cmd,
    env,
    torchrun_cmd,
    write_rows,
)


def ray_cmd(*args: str) -> list[str]:
    return dagrl_cmd("train", "trainer.n_workers=2", *args)


LAUNCHERS = {"ray": ray_cmd, "torchrun": torchrun_cmd, "dagrl-torchrun": dagrl_torchrun_cmd}


def bad_input(tmp_path, kind: str) -> tuple[list[str], str, str]:
    """(overrides, error type, what the line must name) for a data, graph or config error."""
    if kind == "data":
        rows = arith_rows(8)
        for i, row in enumerate(rows):
            row["reward_model"]["ground_truth"] = i + 1
        data = write_rows(tmp_path / "int_truth.parquet", rows)
        return ([f"data.train_files=[{data}]"], "error: ",
                f"{data}: column reward_model.ground_truth is int64")
    if kind == "graph":
        graph = tmp_path / "graph.yaml"
        graph.write_text(textwrap.dedent("""
            name: g
            nodes:
              - {id: rollout, role: rollout}
              - {id: reward, role: reward, deps: [rollout]}
              - {id: update, role: actor_update, deps: [advantage]}
        """))
        return ([f"dag.graph={graph}"], "error: ",
                "node 'update' depends on unknown node(s) ['advantage']")
    return (["actor.lr=-1"], "error: ", "actor.lr must be > 0")


def launch(cmd: list[str], timeout: float = 300):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env())
    tree = ProcessTree(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seen = tree.stop()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), seen


# Under Ray the driver runs the pre-flight once for every kind of bad input (one case of it
# here); under torchrun every rank runs it, and rank 0 alone may speak (each kind).
@pytest.mark.parametrize("launcher,kind", [
    ("torchrun", "data"), pytest.param("torchrun", "graph", marks=pytest.mark.slow),
    pytest.param("torchrun", "config", marks=pytest.mark.slow),
    pytest.param("ray", "data", marks=pytest.mark.slow), ("dagrl-torchrun", "data"),
    ("dagrl-torchrun", "config")])
def test_bad_input_with_two_workers_is_one_line(tmp_path, launcher, kind):
    overrides, error, shown = bad_input(tmp_path, kind)
    proc, started = launch(LAUNCHERS[launcher](f"trainer.run_dir={tmp_path / 'run'}", *SMALL,
                                               *overrides))
    assert proc.returncode != 0
    assert_one_error_line(proc, error, shown)
    assert not (tmp_path / "run").exists()
    if launcher == "dagrl-torchrun" and kind == "data":
        # dagrl's launcher checks the files itself before torchrun's agent starts any worker
        assert not started, started
    if launcher != "torchrun":   # the line is the whole output (torchrun adds its summary)
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    else:                   # no worker traceback; torchrun's root cause is our line
        assert "[rank" not in proc.stderr and proc.stderr.count("Traceback") <= 1
        assert shown in proc.stderr.split("Root Cause")[-1]


RANK1_FAILS = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # The pre-flight's probe scores the ground truth itself: crash only on the model's answers.
    if os.environ["RANK"] == "1" and solution_str != ground_truth:
        raise RuntimeError("scorer crashed on rank 1")
    return 0.0
"""


# Through dagrl's own torchrun launch in the main suite; plain torchrun and Ray (a Ray instance
# each): -m slow.
@pytest.mark.parametrize("launcher", [pytest.param("ray", marks=pytest.mark.slow),
                                      pytest.param("torchrun", marks=pytest.mark.slow),
                                      "dagrl-torchrun"])
def test_a_worker_failing_mid_run_is_one_line_and_a_logged_traceback(tmp_path, launcher):
    """Rank 1 fails at step 1; rank 0 then fails too (its peer is gone), but rank 1's error is
    the line shown, with a hint; both tracebacks are in dagrl.log; no process is left."""
    reward = tmp_path / "rank1_fails.py"
    reward.write_text(RANK1_FAILS)
    run_dir = tmp_path / "run"
    proc, started = launch(LAUNCHERS[launcher](f"trainer.run_dir={run_dir}", *SMALL,
                                               f"reward.custom_fn={reward}:compute_score"))
    assert proc.returncode == 1
    line = assert_one_error_line(proc, "error: rank 1: reward failed for sample",
                                 "scorer crashed on rank 1")
    lines = proc.stderr.splitlines()
    assert lines[lines.index(line) + 1] == \
        f"hint: the traceback is in {run_dir / 'dagrl.log'} (--debug prints it here)"
    if launcher == "dagrl-torchrun":   # the line and its hint: the whole output
        assert proc.stderr.strip().splitlines() == [line, lines[lines.index(line) + 1]]
    elif launcher == "ray":
        assert "Traceback" not in proc.stderr and "WorkerFailed" not in proc.stderr
    else:
        assert "[rank" not in proc.stderr and proc.stderr.count("Traceback") == 1  # torchrun's
        assert "scorer crashed on rank 1" in proc.stderr.split("Root Cause")[-1]
    log = (run_dir / "dagrl.log").read_text()
    assert "rank 1 (pid" in log and 'raise RuntimeError("scorer crashed on rank 1")' in log
    assert not [p for p in started if alive(p)]
