"""The DAG worker: one per device, every one running the same loop over its own task list.

    for step in steps:
        batch = this rank's slice of the step's prompts (read from parquet by this rank)
        for task in this rank's plan:
            node task    -> batch = role(ctx, batch)  (timed, memory, profiled: observe/observer.py)
            reshard      -> samples move to the next node's ranks (all_to_all, no coordinator)
            balance      -> whole groups move so ranks hold similar token counts
        metrics = reduce(this rank's statistics) over all ranks
        rank 0 logs them
        every trainer.val_every steps: validate (each rank on its share of the test split)
        every trainer.save_every steps: checkpoint (each rank writes its shards; atomic commit)

A worker first resumes from a checkpoint when `trainer.resume` finds one (runtime/checkpoint.py).

The launcher (in-process, Ray or torchrun) only starts workers and waits for them; rank 0
prepares the run directory and tells the others the resolved config.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from dagrl.config.models import model_config
from dagrl.config.schema import Config
from dagrl.dag.planner import RankPlan, Task
from dagrl.data.batch import Batch
from dagrl.data.buffer import balance, reshard
from dagrl.data.dataset import ParquetPrompts, PromptLoader
from dagrl.data.replicas import from_replicas, to_replicas
from dagrl.device import is_host
from dagrl.engines.bundle import build_engines
from dagrl.engines.host_memory import release_freed_memory
from dagrl.engines.memory_estimate import (
    ModelShape,
    estimate_memory,
    estimated_peak,
    other_model_lines,
    other_model_shapes,
)
from dagrl.engines.models import load_tokenizer
from dagrl.observe.loggers import GENERATIONS_FILE, RunLogger, append_generations, truncate_jsonl
from dagrl.observe.memory import GB, host_rss_bytes
from dagrl.observe.metrics import StepMetrics
from dagrl.observe.observer import StepObserver
from dagrl.roles.multi_model import PrefixedMetrics, merge_view, model_view, prefix_of
from dagrl.roles.plan import engines_of, plan_for
from dagrl.roles.registry import ROLES, NodeContext
from dagrl.runtime.checkpoint import Checkpointer, CheckpointError, Stateful, resolve_resume
from dagrl.runtime.distributed import DistContext, create_layout_groups
from dagrl.runtime.failures import append_run_log
from dagrl.runtime.preflight import check_cpu_threads, check_mixed_precision, check_prompts
from dagrl.runtime.validation import Validator


def _check_rollout_on_every_rank(plans: list[RankPlan]) -> None:
    """vLLM's engines join the process group when they start (rollout/vllm.py): a rank without
    the rollout node would leave the others waiting."""
    missing = [p.rank for p in plans if "rollout" not in engines_of(p)]
    if missing:
        raise ValueError(f"rollout.backend=vllm with several workers needs the rollout node on "
                         f"every rank; ranks {missing} have none (drop the node's options.ranks)")


def _fingerprint(batch: Batch) -> tuple:
    """What identifies a replica's samples: their number and group ids."""
    return (len(batch), tuple(batch["uid"]) if "uid" in batch else ())


class Worker:
    """One rank's worker. `cfg` must be resolved (see launch.prepare_run); `dist_ctx` says which
    rank this is (default: a single worker)."""

    def __init__(self, cfg: Config, dist_ctx: DistContext | None = None) -> None:
        self.dist = dist_ctx or DistContext()
        runtime_rss = host_rss_bytes()   # Python, torch, transformers: before any model
        self.cfg, self.run_dir = cfg, Path(cfg.trainer.run_dir)
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.device = self.dist.device
        self.trim_host_memory = cfg.trainer.trim_host_memory and is_host(self.device)
        self.graph, self.order, plans = plan_for(cfg, self.world_size)
        create_layout_groups(self.dist, plans)
        self.plan = plans[self.rank]
        needed = engines_of(self.plan)
        t = cfg.trainer
        validates = t.val_every > 0 or t.val_before_train
        if validates:   # every rank validates its share of the test split
            needed |= {"rollout", "reward"}
        elif cfg.rollout.backend == "vllm" and self.world_size > 1:
            _check_rollout_on_every_rank(plans)
        # The data first: a bad file is reported before minutes of model loading.
        d = cfg.data
        train_source = ParquetPrompts(d.train_files, d.prompt_key)
        val_source = (ParquetPrompts(d.val_files, d.prompt_key, config_key="data.val_files")
                      if validates else None)
        # Pre-flight: what needs only the tokenizer (batch divisibility, prompt lengths, CPU
        # threads) is checked before minutes of model loading.
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.gguf_file)
        self.loader = PromptLoader(
            train_source, tokenizer,
            batch_size=d.train_batch_size, rank=self.rank, world_size=self.world_size,
            seed=cfg.trainer.seed, shuffle=d.shuffle, tail=d.tail,
            max_prompt_length=d.max_prompt_length, truncation=d.truncation)
        loaders = {"train": self.loader}
        if val_source is not None:
            loaders["val"] = PromptLoader(val_source, tokenizer, batch_size=1, tail="pad",
                                          max_prompt_length=d.max_prompt_length,
                                          truncation=d.truncation)
        check_prompts(loaders, self.log)
        if is_host(self.device):
            check_cpu_threads(t.torch_threads, self.dist.local_world_size, self.log)
        check_mixed_precision(cfg.model.mixed_precision, self.device, self.log)
        self.engines = build_engines(cfg, needed, self.device, world_size=self.world_size,
                                     log=self.log, tokenizer=tokenizer)
        # The config's extra policies (config/models.py), each with its own engines.
        self.model_engines = {
            name: build_engines(model_config(cfg, name), engines_of(self.plan, name),
                                self.device, world_size=self.world_size, log=self.log)
            for name in cfg.models}
        if self.loader.dropped_per_epoch:
            self.log(f"data: {self.loader.dropped_per_epoch} prompt(s) per epoch do not fill a "
                     f"batch of {d.train_batch_size} and are dropped (data.tail=drop)")
        self.validator = (Validator(cfg, val_source, self.engines, self.rank, self.world_size,
                                    self.device) if validates else None)
        self.checkpoint_root = Path(t.checkpoint_dir or self.run_dir / "checkpoints")
        self.checkpointer = Checkpointer(self.checkpoint_root, rank=self.rank,
                                         keep_last=t.keep_last, barrier=self.dist.barrier,
                                         broadcast=self.dist.broadcast_object,
                                         all_ok=self.dist.all_true)
        # The plan's estimate, for the report beside the measured peak: the largest over ranks
        # (a rank without the actor reports 0), so every rank logs the same metrics.
        estimate = 0.0
        if self.engines.actor is not None:
            lines = estimate_memory(cfg, ModelShape.of(self.engines.actor.model.config),
                                    has_ref="ref" in needed, has_critic="critic" in needed)
            with_ref = {name for name in cfg.models if "ref" in engines_of(self.plan, name)}
            lines += other_model_lines(cfg, other_model_shapes(cfg), with_ref)
            estimate = estimated_peak(lines, runtime_rss) / GB
        estimate = self.dist.max_over_ranks(estimate)
        if estimate > 0:
            self.log(f"memory: estimated peak {estimate:.2f} GiB per rank (dagrl plan --memory "
                     "for the breakdown)")
        # Per-task timing, memory, FLOPs and the profiler (dagrl/observe/observer.py).
        self.observer = StepObserver(cfg, self.graph, self.engines, self.rank, self.world_size,
                                     self.device, self.dist.cpu_group,
                                     estimated_peak_gb=estimate or None)
        self.logger: RunLogger | None = None   # rank 0's, created when training starts
        self._replicated: tuple = ()   # the training layout's samples when last balanced

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[dagrl] {message}", flush=True)

    def log_event(self, message: str) -> None:
        """A message that also belongs in the run's log (dagrl.log): checkpoint fallbacks."""
        self.log(message)
        if self.rank == 0:
            append_run_log(self.run_dir, message)

    def run_step(self, step: int) -> dict[str, float]:
        """Run this rank's plan once; returns the step's metrics reduced over all ranks."""
        metrics = StepMetrics()
        step_start = time.perf_counter()
        batch = self.run_tasks(self.plan.tasks, step, metrics)
        metrics.add_max("timing/step_s", time.perf_counter() - step_start)
        replicated = self.plan.tasks and self.plan.tasks[-1].group > 1
        # A replica's samples count once, not on each of its ranks.
        metrics.add_sum("batch/samples", len(batch)
                        if not replicated or self.dist.is_replica_leader else 0)
        result = metrics.reduce(self.dist.cpu_group if self.dist.distributed else None)
        return self.observer.finish_step(step, result)

    def run_tasks(self, tasks: tuple[Task, ...], step: int, metrics: StepMetrics) -> Batch:
        """Run `tasks` (the plan, or a prefix of it) on this rank's next prompts: the worker
        loop. A node task calls its role; reshard and balance move samples between ranks."""
        batch = self.loader.next_batch().to(self.device)
        most = len(batch)
        for i, task in enumerate(tasks):
            # The ranks of a replica compute the same node metrics: they count once.
            sink = StepMetrics() if task.group > 1 else metrics
            with self.observer.measure(step, task, metrics):
                if task.kind == "reshard":
                    batch = reshard(batch, task.src, task.dst, device=self.device)
                elif task.kind == "replicate":
                    batch = self._replicate(batch, task.group)
                elif task.kind == "unreplicate":
                    batch = from_replicas(batch, task.group, self.rank % task.group)
                elif task.kind == "balance" and task.group > 1:
                    batch = self._rebalance_replicas(batch, task.group)
                elif task.kind == "balance":
                    batch = balance(batch, tuple(range(len(task.dst))),
                                    self.dist.group_for(task.dst), device=self.device)
                elif task.model:   # another policy's node: it sees its own fields
                    ctx = self.node_context(task, step, sink, upstream=tasks[:i],
                                            step_metrics=metrics)
                    out = ROLES.get(task.role).fn(ctx, model_view(batch, task.model))
                    batch = merge_view(batch, out, task.model, task.node_id)
                else:
                    ctx = self.node_context(task, step, sink, upstream=tasks[:i],
                                            step_metrics=metrics)
                    batch = ROLES.get(task.role).fn(ctx, batch)
                if task.kind == "node" and self.trim_host_memory:
                    release_freed_memory()
            if not task.model:   # FLOPs are counted for the main policy's model only
                self.observer.count_flops(task, batch, sink)
            if sink is not metrics and self.dist.is_replica_leader:
                metrics.merge(sink)
            most = max(most, len(batch))
        # The most samples this rank held at any point: no rank should ever hold the global batch.
        metrics.add_max("batch/max_samples_per_rank", most)
        return batch

    def _replicate(self, batch: Batch, group_size: int) -> Batch:
        """Into the training layout (data/replicas.py); remembers what each replica got, so a
        balance before the update can tell whether anything changed since."""
        batch = to_replicas(batch, group_size, self.dist.replica_group, device=self.device)
        self._replicated = _fingerprint(batch)
        return batch

    def _rebalance_replicas(self, batch: Batch, group_size: int) -> Batch:
        """A balance in the training layout: back to shards and into balanced replicas again,
        unless no replica's samples changed since they were balanced (one flag all-reduce)."""
        changed = torch.tensor([float(_fingerprint(batch) != self._replicated)])
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.dist.cpu_group)
        if not changed.item():
            return batch
        return self._replicate(from_replicas(batch, group_size, self.rank % group_size),
                               group_size)

    def node_context(self, task: Task, step: int, metrics: StepMetrics,
                     upstream: tuple[Task, ...],
                     step_metrics: StepMetrics | None = None) -> NodeContext:
        """`metrics`: where the node records; `step_metrics`: where the upstream tasks that
        `ctx.more()` runs again record (default: the same). A node of an extra policy (`model`)
        gets that policy's config and engines, and its metrics get the policy's prefix."""
        again = metrics if step_metrics is None else step_metrics
        # In the training layout a sum over the replicas counts each sample once: over the
        # ranks at this rank's position in every replica.
        group = self.dist.peer_group if task.group > 1 else self.dist.group_for(task.dst)
        m = task.model
        return NodeContext(model_config(self.cfg, m), self.graph.node(task.node_id), step,
                           self.rank, self.world_size,
                           self.model_engines[m] if m else self.engines,
                           PrefixedMetrics(metrics, prefix_of(m)) if m else metrics,
                           reduce_sum=self._reducer(group),
                           more=lambda: self.run_tasks(upstream, step, again),
                           model_engines=self.model_engines)

    def _reducer(self, group):
        if not self.dist.distributed:
            return lambda t: t

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            out = t.detach().to(self.device).clone()
            dist.all_reduce(out, group=group)
            return out.to(t.device)

        return reduce_sum

    # --- the run -----------------------------------------------------------------------------
    def train(self) -> list[dict[str, float]]:
        """Resume if a checkpoint is found, then train to trainer.total_steps. Returns the
        metrics of the steps run by this call."""
        t = self.cfg.trainer
        start = self.resume()
        if self.rank == 0:
            self.logger = RunLogger(self.cfg.logging, self.run_dir, t.total_steps,
                                    start_step=start)
        history = []
        try:
            if t.val_before_train and start == 0:
                self._log(0, self.validate(0))
            for step in range(start + 1, t.total_steps + 1):
                metrics = self.run_step(step)
                last = step == t.total_steps
                if t.val_every and (step % t.val_every == 0 or last):
                    metrics.update(self.validate(step))
                history.append(metrics)
                self._log(step, metrics)
                # After a step that finished cleanly: a step that raised (a NaN loss, say)
                # never reaches this, so the previous checkpoint stays the newest.
                if t.save_every and (step % t.save_every == 0 or last):
                    self.save_checkpoint(step)
        finally:
            if self.logger is not None:
                self.logger.close()
        return history

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def validate(self, step: int) -> dict[str, float]:
        metrics = self.validator.run()
        if self.validator.samples:      # rank 0, logging.val_generations > 0
            append_generations(self.run_dir / GENERATIONS_FILE, step, self.validator.samples)
        return metrics.reduce(self.dist.cpu_group if self.dist.distributed else None)

    # --- checkpoints ---------------------------------------------------------------------------
    def trained_engines(self) -> dict:
        """The engines a checkpoint holds, by name: actor, critic, and `<model>:actor` /
        `<model>:critic` of each extra policy."""
        out = {}
        bundles = {"": self.engines, **self.model_engines}
        for model, engines in bundles.items():
            for name in ("actor", "critic"):
                engine = getattr(engines, name)
                if engine is not None:
                    out[f"{model}:{name}" if model else name] = engine
        return out

    def stateful_engines(self) -> dict[str, Stateful]:
        return {name: Stateful(e.model, e.optimizer, e.scheduler)
                for name, e in self.trained_engines().items()}

    def save_checkpoint(self, step: int) -> Path:
        e = self.engines
        state = {"loader": self.loader.state_dict(), "world_size": self.world_size,
                 "versions": {name: engine.version
                              for name, engine in self.trained_engines().items()},
                 "kl_controller": e.kl_controller.state_dict() if e.kl_controller else None}
        path = self.checkpointer.save(step, self.stateful_engines(), state,
                                      hf_files=self.engines.write_hf_files)
        self.log(f"checkpoint: step {step} -> {path}")
        return path

    def resume(self) -> int:
        """Load the checkpoint `trainer.resume` selects; returns its step (0: none)."""
        resume = self.cfg.trainer.resume
        if resume == "auto":   # the newest that loads completely, falling back past damage
            found = self.checkpointer.load_newest(self.stateful_engines(), self.log_event)
            if found is None:
                return 0
            path, state = found
        else:
            path = resolve_resume(resume, self.checkpoint_root)
            if path is None:
                return 0
            state = self.checkpointer.load(path, self.stateful_engines())
        e = self.engines
        try:
            self.loader.load_state_dict(state["loader"])
        except ValueError as err:   # another dataset or batch size than the checkpointed run's
            raise CheckpointError(f"checkpoint {path}: {err}") from err
        trained = self.trained_engines()
        for name, version in state["versions"].items():
            trained[name].version = version
        if e.kl_controller is not None and state["kl_controller"] is not None:
            e.kl_controller.load_state_dict(state["kl_controller"])
        for engines in (e, *self.model_engines.values()):
            engines.synced_version = -1   # the rollout engines still hold the initial weights
            engines.sync_rollout_weights()
        step = int(state["step"])
        if self.rank == 0:
            truncate_jsonl(self.run_dir / "metrics.jsonl", step)
            truncate_jsonl(self.run_dir / GENERATIONS_FILE, step)
        self.log(f"resumed from {path} (step {step}, saved by {state['world_size']} worker(s), "
                 f"now {self.world_size})")
        return step

