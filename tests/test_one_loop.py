"""Sync and async runs are two placements of one plan, stepped by one loop (issue 33): a node on
each side of an async run, and the same nodes in a sync run, find `Worker.run_step` and
`Worker.run_tasks` on their call stack, and no other loop. The nodes record the stack from
inside the run (a user role on the trainer side, the reward function on the rollout side)."""

from __future__ import annotations

import json
import textwrap

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.runtime.launch import launch
from tests.test_async_runs import FAST, SMALL, torchrun

RECORDER = textwrap.dedent('''
    import json
    import os
    import sys

    from dagrl.rewards.scorers import arith_score

    OUT = OUT_DIR


    def _record(kind):
        frames, f = [], sys._getframe(2)
        while f is not None:
            frames.append(f.f_code.co_qualname)
            f = f.f_back
        with open(os.path.join(OUT, f"{kind}-{os.getpid()}.json"), "w") as out:
            json.dump(frames, out)


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        _record("reward")
        return arith_score(solution_str, ground_truth, extra_info)
''')
# The node's module (dag.modules) imports the recorder; the reward function loads it as its own
# file (reward.custom_fn), which must not register the role a second time.
NODE = textwrap.dedent('''
    import importlib.util

    from dagrl import register_role

    _spec = importlib.util.spec_from_file_location("stack_recorder_ROLE", RECORDER_PATH)
    _recorder = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_recorder)


    @register_role("ROLE")
    def record_stack(ctx, batch):
        _recorder._record("node")
        return batch
''')
GRAPH = textwrap.dedent("""
    name: grpo_stack
    nodes:
      - {id: rollout, role: rollout}
      - {id: reward, role: reward, deps: [rollout]}
      - {id: record, role: ROLE, deps: [reward]}
      - {id: advantage, role: advantage, deps: [record]}
      - {id: actor_update, role: actor_update, deps: [advantage]}
""")


def _run(tmp_path, name: str, *overrides: str, processes: bool = False):
    out = tmp_path / f"{name}-stacks"
    out.mkdir()
    role = f"record_stack_{name}"   # a process registers a name once
    recorder = tmp_path / f"{name}_recorder.py"
    recorder.write_text(RECORDER.replace("OUT_DIR", repr(str(out))))
    (tmp_path / f"{name}.py").write_text(
        NODE.replace("RECORDER_PATH", repr(str(recorder))).replace("ROLE", role))
    (tmp_path / f"{name}.yaml").write_text(GRAPH.replace("ROLE", role))
    args = ["trainer.total_steps=1", f"dag.modules=[{tmp_path / f'{name}.py'}]",
            f"dag.graph={tmp_path / f'{name}.yaml'}", f"reward.custom_fn={recorder}:compute_score",
            *SMALL, *overrides]
    if processes:   # 2 workers under torchrun
        torchrun(tmp_path / name, *args)
    else:
        launch(load_config(Config, None, [f"trainer.run_dir={tmp_path / name}", *FAST, *args]))
    stacks: dict[str, list[list[str]]] = {"node": [], "reward": []}
    pids: dict[str, set[str]] = {"node": set(), "reward": set()}
    for path in sorted(out.iterdir()):
        kind, pid = path.stem.split("-")
        stack = json.loads(path.read_text())
        if "probe_reward" in stack:   # the pre-flight's one call before training: not a step
            continue
        stacks[kind].append(stack)
        pids[kind].add(pid)
    return stacks, pids


def _stepped_by_the_worker_loop(stack: list[str]) -> bool:
    return "Worker.run_step" in stack and "Worker.run_tasks" in stack


def test_sync_and_async_nodes_run_in_the_same_step_function(tmp_path):
    sync, sync_pids = _run(tmp_path, "sync")
    asynchronous, async_pids = _run(tmp_path, "async", "trainer.mode=async",
                                    "rollout.max_staleness=1", processes=True)
    for stacks in (sync, asynchronous):
        assert stacks["node"] and stacks["reward"], stacks   # both recorded
        for stack in stacks["node"] + stacks["reward"]:
            assert _stepped_by_the_worker_loop(stack), stack
            assert not [f for f in stack if "Loop" in f or "AsyncWorker" in f], stack
    # One process in the sync run; in the async run the two sides are different processes.
    assert sync_pids["node"] == sync_pids["reward"]
    assert async_pids["node"] and not async_pids["node"] & async_pids["reward"]
