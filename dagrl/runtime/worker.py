"""The DAG worker: one per device, every one running the same loop over its own task list.

    for step in steps:
        batch = this rank's slice of the step's prompts (read from parquet by this rank)
        for task in this rank's plan:
            node task    -> batch = role(ctx, batch)          (timed: timing/<node>_s)
        metrics = reduce(this rank's statistics) over all ranks
        rank 0 logs them

There is no coordinator: the launcher only starts workers and waits for them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dagrl.config.schema import Config
from dagrl.dag.builtin import BUILTIN_GRAPHS
from dagrl.dag.planner import RankPlan, make_plan
from dagrl.dag.roles import import_user_modules, load_builtin_roles
from dagrl.dag.spec import GraphSpec, load_graph_yaml, validate_graph
from dagrl.data.dataset import ParquetPrompts, PromptLoader
from dagrl.observe.loggers import RunLogger
from dagrl.observe.metrics import StepMetrics
from dagrl.runtime.device import device_type, worker_device
from dagrl.runtime.engines import build_engines
from dagrl.runtime.nodes import NodeContext


def build_graph(cfg: Config) -> GraphSpec:
    """The configured graph: `dag.graph` (a built-in name or a YAML file), else the built-in
    graph of `algorithm.name`."""
    name = cfg.dag.graph or cfg.algorithm.name
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        return load_graph_yaml(name)
    return BUILTIN_GRAPHS.get(name)(cfg)


def plan_for(cfg: Config, world_size: int) -> tuple[GraphSpec, list[str], list[RankPlan]]:
    """Import user roles, build and validate the graph, and plan it for `world_size` ranks."""
    import_user_modules(cfg.dag.modules)
    roles = load_builtin_roles()
    graph = build_graph(cfg)
    order = validate_graph(graph, roles)
    return graph, order, make_plan(graph, order, world_size)


class Worker:
    def __init__(self, cfg: Config, run_dir: Path, *, rank: int = 0, world_size: int = 1,
                 local_rank: int = 0) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.rank, self.world_size = rank, world_size
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.device = worker_device(device_type(cfg.trainer.device), local_rank)
        self.graph, self.order, plans = plan_for(cfg, world_size)
        self.plan = plans[rank]
        roles = load_builtin_roles()
        needed = {e for t in self.plan.tasks if t.kind == "node" for e in roles.get(t.role).engines}
        self.roles = roles
        self.engines = build_engines(cfg, needed, self.device, log=self.log)
        d = cfg.data
        self.loader = PromptLoader(
            ParquetPrompts(d.train_files, d.prompt_key), self.engines.tokenizer,
            batch_size=d.train_batch_size, rank=rank, world_size=world_size,
            seed=cfg.trainer.seed, shuffle=d.shuffle, tail=d.tail,
            max_prompt_length=d.max_prompt_length, truncation=d.truncation)
        if self.loader.dropped_per_epoch:
            self.log(f"data: {self.loader.dropped_per_epoch} prompt(s) per epoch do not fill a "
                     f"batch of {d.train_batch_size} and are dropped (data.tail=drop)")
        self.logger = (RunLogger(cfg.logging, self.run_dir, cfg.trainer.total_steps)
                       if rank == 0 else None)

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[dagrl] {message}", flush=True)

    def run_step(self, step: int) -> dict[str, float]:
        """Run this rank's plan once; returns the step's metrics reduced over all ranks."""
        metrics = StepMetrics()
        step_start = time.perf_counter()
        batch = self.loader.next_batch().to(self.device)
        for task in self.plan.tasks:
            if task.kind != "node":
                raise NotImplementedError(f"task kind {task.kind!r} needs the multi-worker "
                                          "runtime")
            node = self.graph.node(task.node_id)
            ctx = NodeContext(self.cfg, node, step, self.rank, self.world_size, self.engines,
                              metrics)
            start = time.perf_counter()
            batch = self.roles.get(task.role).fn(ctx, batch)
            metrics.add_max(f"timing/{task.node_id}_s", time.perf_counter() - start)
        step_s = time.perf_counter() - step_start
        metrics.add_max("timing/step_s", step_s)
        result = metrics.reduce(dist.group.WORLD if dist.is_initialized() else None)
        if "tokens/total" in result:
            result["throughput/tokens_per_s"] = result["tokens/total"] / result["timing/step_s"]
        return result

    def train(self) -> list[dict[str, float]]:
        history = []
        try:
            for step in range(1, self.cfg.trainer.total_steps + 1):
                metrics = self.run_step(step)
                history.append(metrics)
                if self.logger is not None:
                    self.logger.log(step, metrics)
        finally:
            if self.logger is not None:
                self.logger.close()
        return history
