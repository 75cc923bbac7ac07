"""What a worker measures around each task, and the metrics derived from a reduced step.

Per task (node, reshard or balance; `<name>` is the node id, or `reshard_<id>` / `balance_<id>`):
  timing/<name>_s          slowest rank's time (max over ranks)
  timing/<name>_spread_s   straggler spread: slowest minus fastest rank
  memory/<name>_host_gb    host RSS after the task (max over ranks)
  memory/<name>_host_peak_gb  host RSS peak during the task, sampled (max over ranks)
  memory/<name>_device_gb  device peak during the task (max over ranks; not on the CPU)
Per step:
  memory/host_peak_gb, memory/device_peak_gb        process peaks (max over ranks)
  memory/estimated_peak_gb                          dagrl plan --memory's estimate (max over ranks)
  throughput/tokens_per_s                           prompt + response tokens / step time
  perf/tflops_per_device                            model FLOPs (see flops.py) / time / workers
  perf/mfu                                          the same over the device's peak, if known
and the profiler (profiler.py) records the chosen tasks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from dagrl.config.schema import Config
from dagrl.dag.planner import Task
from dagrl.dag.spec import GraphSpec
from dagrl.device import device_name
from dagrl.observe.flops import batch_tokens, matmul_params, peak_tflops, role_flops_per_token
from dagrl.observe.memory import GB, NodeMemory, host_peak_bytes
from dagrl.observe.metrics import StepMetrics
from dagrl.observe.profiler import TaskProfiler


def task_name(task: Task) -> str:
    return task.node_id if task.kind == "node" else f"{task.kind}_{task.node_id}"


class StepObserver:
    """One worker's per-task measurements. `engines` supplies the model size for FLOPs."""

    def __init__(self, cfg: Config, graph: GraphSpec, engines, rank: int, world_size: int,
                 device, estimated_peak_gb: float | None = None) -> None:
        """`rank`: the global rank (its trace's name); `world_size`: the ranks whose FLOPs a
        step's reduced metrics hold (the side's). `estimated_peak_gb`: the memory estimate's
        peak per rank (dagrl plan --memory), logged beside the measured peaks as
        memory/estimated_peak_gb."""
        self.world_size, self.device = world_size, device
        self.estimated_peak_gb = estimated_peak_gb
        self.profiler = TaskProfiler(cfg.profiler, graph.roles, rank, device,
                                     Path(cfg.trainer.run_dir))
        self.memory = NodeMemory(device)
        model = _a_policy_model(engines)
        self.n_params = matmul_params(model) if model is not None else 0
        self.passes = {"actor_update": cfg.actor.ppo_epochs, "critic_update": cfg.critic.ppo_epochs}
        self.peak_tflops = peak_tflops(device_name(device), cfg.model.dtype)

    @contextlib.contextmanager
    def measure(self, step: int, task: Task, metrics: StepMetrics) -> Iterator[None]:
        """Record the time and memory of the task run inside the `with` block (and profile it
        when the profiler is configured to)."""
        name = task_name(task)
        self.memory.start()
        start = time.perf_counter()
        with self.profiler.task(step, task):
            yield
        seconds = time.perf_counter() - start
        host, host_peak, device = self.memory.stop()
        # Both extremes over ranks: the max is the node's time, max - min its straggler spread.
        metrics.add_max(f"timing/{name}_s", seconds)
        metrics.add_min(f"timing/{name}_min_s", seconds)
        metrics.add_max(f"memory/{name}_host_gb", host / GB)
        metrics.add_max(f"memory/{name}_host_peak_gb", host_peak / GB)
        metrics.add_max("memory/host_peak_gb", host_peak_bytes() / GB)
        if device is not None:
            metrics.add_max(f"memory/{name}_device_gb", device / GB)
            metrics.add_max("memory/device_peak_gb", device / GB)
        if self.profiler.records(step, task):
            sample = {"host_rss_mb": host / 2**20}
            if device is not None:
                sample["device_peak_mb"] = device / 2**20
            self.profiler.counter(sample)

    def count_flops(self, task: Task, batch, metrics: StepMetrics) -> None:
        """Model FLOPs of a node task, from the tokens of the batch it returned."""
        if task.kind != "node":
            return
        flops = role_flops_per_token(task.role, self.n_params, self.passes.get(task.role, 1))
        if flops:
            metrics.add_sum("perf/flops", flops * batch_tokens(batch))

    def finish_step(self, step: int, result: dict[str, float]) -> dict[str, float]:
        """Derived metrics of a reduced step."""
        out = dict(result)
        if self.estimated_peak_gb is not None:
            out["memory/estimated_peak_gb"] = self.estimated_peak_gb
        for key in [k for k in out if k.startswith("timing/") and k.endswith("_min_s")]:
            fastest = out.pop(key)
            base = key[:-len("_min_s")]
            out[f"{base}_spread_s"] = out[f"{base}_s"] - fastest
        step_s = out.get("timing/step_s")
        if step_s:
            if "tokens/total" in out:
                out["throughput/tokens_per_s"] = out["tokens/total"] / step_s
            if out.get("perf/flops"):
                achieved = out["perf/flops"] / step_s / self.world_size / 1e12
                out["perf/tflops_per_device"] = achieved
                if self.peak_tflops:
                    out["perf/mfu"] = achieved / self.peak_tflops
        return dict(sorted(out.items()))


def _a_policy_model(engines):
    """The actor's model (or the rollout engine's / reference's on ranks without an actor)."""
    for holder, attr in ((engines.actor, "model"), (engines.rollout, "model"),
                         (engines, "ref_model")):
        model = getattr(holder, attr, None) if holder is not None else None
        if model is not None:
            return model
    return None
