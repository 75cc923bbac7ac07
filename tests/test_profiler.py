"""Profiling: two workers write one merged Chrome trace with both ranks, a span per DAG node
and the reshard/balance tasks; per-node timing spread, memory and FLOPs metrics."""

from __future__ import annotations

import json
import textwrap

import pytest

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.schema import Config
from dagrl.observe.flops import matmul_params, peak_tflops, role_flops_per_token
from dagrl.observe.profiler import merge_traces
from tests.dist_helpers import run_distributed

SMALL = ["data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=4",
         "logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]

# The reward node on rank 0 only: the plan reshards to it and back, so reshard spans appear.
SUBSET_GRAPH = """
    name: grpo_reward_on_rank0
    nodes:
      - {id: rollout, role: rollout}
      - {id: reward, role: reward, deps: [rollout], options: {ranks: [0]}}
      - {id: old_logprob, role: old_logprob, deps: [rollout]}
      - {id: ref_logprob, role: ref_logprob, deps: [rollout]}
      - {id: advantage, role: advantage, deps: [reward]}
      - {id: actor_update, role: actor_update, deps: [advantage, old_logprob, ref_logprob]}
"""
NODES = ["rollout", "reward", "old_logprob", "ref_logprob", "advantage", "actor_update"]


def _profiled_worker(rank, world, overrides):
    from dagrl.runtime.process import run_worker_from_env

    return run_worker_from_env(load_config(Config, None, overrides))


def test_two_workers_write_one_merged_trace(tmp_path):
    graph = tmp_path / "graph.yaml"
    graph.write_text(textwrap.dedent(SUBSET_GRAPH))
    run_dir = tmp_path / "run"
    overrides = [f"trainer.run_dir={run_dir}", "trainer.n_workers=2", "trainer.total_steps=2",
                 f"dag.graph={graph}", "profiler.enable=true", "profiler.steps=[2]", *SMALL]
    history = run_distributed(_profiled_worker, 2, overrides)[0]

    trace = json.loads((run_dir / "profile" / "trace.json").read_text())   # valid JSON
    events = trace["traceEvents"]
    assert all({"ph", "name", "pid"} <= set(e) for e in events)
    timed = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in timed} == {0, 1}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in timed)
    names = {e["pid"]: {m["args"]["name"]} for m in events
             if m["ph"] == "M" and m["name"] == "process_name" for e in [m]}
    assert names == {0: {"rank 0"}, 1: {"rank 1"}}
    spans = {(e["pid"], e["name"]) for e in timed if e.get("cat") == "user_annotation"}
    for node in NODES:                 # every DAG node is a named span (reward on rank 0 only)
        assert (0, f"node:{node}") in spans, node
        assert ((1, f"node:{node}") in spans) == (node != "reward"), node
    for rank in (0, 1):                # the reshards to rank 0 and back, and the balance
        for task in ("reshard:reward", "reshard:old_logprob", "balance:actor_update"):
            assert (rank, task) in spans, (rank, task)
    assert all(e["args"]["step"] == 2 for e in timed if e["name"].startswith("node:"))
    # the collectives under the reshard are visible
    assert any("gloo" in e["name"] or e["name"] == "record_param_comms" for e in timed)
    assert any(e["ph"] == "C" and "host_rss_mb" in e["args"] for e in events)
    for rank in (0, 1):
        per_rank = json.loads((run_dir / "profile" / f"rank{rank}.trace.json").read_text())
        assert per_rank["dagrl"]["rank"] == rank and per_rank["traceEvents"]

    step = history[-1]
    for node in NODES:
        assert step[f"timing/{node}_spread_s"] >= 0 and f"timing/{node}_min_s" not in step
        assert step[f"memory/{node}_host_gb"] > 0
        assert step[f"memory/{node}_host_peak_gb"] >= step[f"memory/{node}_host_gb"]
    assert step["timing/reshard_reward_spread_s"] >= 0
    assert step["perf/tflops_per_device"] > 0 and "perf/mfu" not in step   # CPU: no known peak


def _trace(rank, base_ns, events):
    return {"traceEvents": events, "baseTimeNanoseconds": base_ns,
            "dagrl": {"rank": rank, "steps": [1], "roles": []}}


def test_merge_puts_ranks_on_one_clock_and_one_track_each():
    meta = [{"ph": "M", "name": "process_name", "pid": 77, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "thread_name", "pid": 77, "tid": 5, "args": {"name": "main"}}]
    a = _trace(0, 1_000_000, meta + [
        {"ph": "X", "name": "node:a", "pid": 77, "tid": 5, "ts": 10.0, "dur": 5.0},
        {"ph": "s", "name": "flow", "pid": 77, "tid": 5, "ts": 11.0, "id": 1}])
    b = _trace(1, 3_000_000, meta + [      # its clock origin is 2000 us later
        {"ph": "X", "name": "node:a", "pid": 77, "tid": 5, "ts": 10.0, "dur": 5.0},
        {"ph": "s", "name": "flow", "pid": 77, "tid": 5, "ts": 11.0, "id": 1},
        {"ph": "C", "name": "memory", "pid": 77, "tid": 0, "ts": 12.0, "args": {"x": 1}}])
    merged = merge_traces([b, a])
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"]) for e in spans] == [(0, 0.0), (1, 2000.0)]
    flows = [e["id"] for e in merged["traceEvents"] if e["ph"] == "s"]
    assert len(set(flows)) == 2
    threads = [e for e in merged["traceEvents"] if e["name"] == "thread_name"]
    assert [(e["pid"], e["args"]["name"]) for e in threads] == [(0, "main"), (1, "main")]
    json.dumps(merged)


def test_profiler_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="profiler.steps"):
        load_config(Config, None, ["profiler.enable=true", "profiler.steps=[5]",
                                   "trainer.total_steps=3"])
    with pytest.raises(ConfigError, match="profiler.ranks"):
        load_config(Config, None, ["profiler.enable=true", "profiler.ranks=[1]"])
    import torch

    from dagrl.config.schema import ProfilerConfig
    from dagrl.observe.profiler import TaskProfiler

    with pytest.raises(ConfigError, match="profiler.roles.*actr"):
        TaskProfiler(ProfilerConfig(enable=True, roles=["actr"]), {"rollout", "actor_update"},
                     0, torch.device("cpu"), tmp_path)


def test_flops_and_peaks(tiny_model):
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.5
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    assert peak_tflops("cpu", "float32") is None and peak_tflops("Some GPU", "bfloat16") is None
    n = matmul_params(tiny_model)
    total = sum(p.numel() for p in tiny_model.parameters())
    assert 0 < n <= total
    assert role_flops_per_token("actor_update", n, passes=2) == 12 * n
    assert role_flops_per_token("rollout", n) == 2 * n
    assert role_flops_per_token("reward", n) == 0


def test_nested_task_peak_counts_towards_the_enclosing_task(monkeypatch):
    import torch

    from dagrl.observe import memory

    peaks = iter([100, 50, 70])      # outer before the inner reset, inner's peak, outer's rest
    monkeypatch.setattr(memory, "peak_memory_bytes", lambda device: next(peaks))
    monkeypatch.setattr(memory, "reset_peak_memory", lambda device: None)
    m = memory.NodeMemory(torch.device("cuda"))
    m.start()
    m.start()
    assert m.stop()[2] == 50
    assert m.stop()[2] == 100         # max(100 before the nested reset, 50, 70 after)


def test_host_peak_sampler_sees_a_short_lived_allocation_inside_its_task():
    import time

    from dagrl.observe.memory import HostPeakSampler, host_rss_bytes

    sampler = HostPeakSampler(every_s=0.001)
    sampler.start()                   # outer task
    sampler.start()                   # inner task: 256 MiB touched, held 0.2 s, freed
    before = host_rss_bytes()
    block = bytearray(256 * 2**20)
    time.sleep(0.2)
    del block
    inner = sampler.stop()[1]
    outer = sampler.stop()[1]
    assert inner - before > 200 * 2**20          # seen while held, gone by the end
    assert host_rss_bytes() - before < 100 * 2**20
    assert outer >= inner                         # the nested peak counts for the outer task
    sampler.start()                               # a later task starts from its own RSS
    assert sampler.stop()[1] - before < 100 * 2**20


def test_a_task_inside_a_recorded_task_is_a_nested_span(tmp_path):
    import torch

    from dagrl.config.schema import ProfilerConfig
    from dagrl.dag.planner import Task
    from dagrl.observe.profiler import TaskProfiler

    prof = TaskProfiler(ProfilerConfig(enable=True, steps=[1]), {"filter", "rollout"}, 0,
                        torch.device("cpu"), tmp_path)
    # DAPO's filter calls ctx.more(): a rollout task runs inside the filter task.
    with prof.task(1, Task("node", "filter", "filter")), \
            prof.task(1, Task("node", "rollout", "rollout")):
        torch.ones(4) @ torch.ones(4)
    prof.counter({"host_rss_mb": 1.0})
    prof.end_step(1)
    path = prof.merge(None, distributed=False)
    spans = {e["name"]: e for e in json.loads(path.read_text())["traceEvents"]
             if e.get("cat") == "user_annotation"}
    outer, inner = spans["node:filter"], spans["node:rollout"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def _push_groups_while_profiling(rank, world, sessions):
    """Rank 0 pushes a batch of groups (isend) inside each of `sessions` profiler sessions, as
    an async rollout rank does in a profiled step; rank 1 takes each one later, so the sends
    complete after their session has stopped."""
    import os
    import tempfile
    import time

    import torch

    from dagrl.data.async_buffer import GroupReceiver, GroupSender
    from dagrl.data.batch import Batch

    batch = Batch({"x": torch.ones(4, 1 << 16)}, {"uid": ["a", "a", "b", "b"]})
    if rank == 1:
        receiver = GroupReceiver([0])
        for i in range(sessions):
            time.sleep(0.01)
            receiver.pull(i)
        return sessions
    sender = GroupSender([1])
    for i in range(sessions):
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with prof, torch.profiler.record_function("node:rollout"):
            sender.push(batch, i, {})
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        prof.export_chrome_trace(path)
        os.unlink(path)
    sender.flush()
    return sessions


def test_sends_that_outlive_a_profiler_session_do_not_crash_it():
    """Without `outliving_profiler` (data/async_buffer.py) rank 0 died with SIGSEGV (3 of 3 runs
    of 200 sessions; this test failed too): the sends closed their record functions in a
    profiler session already gone."""
    assert run_distributed(_push_groups_while_profiling, 2, 150, timeout=120) == [150, 150]
