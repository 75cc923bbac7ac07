"""The DAG worker: one per device, every one running the same loop over its own task list.

    for step in steps:
        batch = source.next_batch(step)    this rank's prompts (read from parquet by this rank),
                                           or, on an async trainer rank, the groups generated
                                           for the step by the rollout ranks
        for task in this rank's tasks:
            node task    -> batch = role(ctx, batch)  (timed, memory, profiled: observe/observer.py)
            reshard      -> samples move to the next node's ranks (all_to_all, no coordinator)
            balance      -> whole groups move so ranks hold similar token counts
        sink.finish(step, batch)           metrics reduced over the side's ranks, or (async
                                           rollout rank) the groups pushed to the trainer ranks
        the lead logs them; every trainer.val_every steps: validate; every trainer.save_every
        steps and after the last: checkpoint (each rank writes its shards; atomic commit)

Sync and async runs are two placements of the same plan (runtime/sides.py): in sync mode every
rank runs every task; in trainer.mode=async the rollout ranks run the rollout side and the
trainer ranks the rest, with a different batch source and sink (runtime/streams.py) and the
actor's weights sent to the rollout ranks instead of this worker's rollout engine
(engines/weight_channel.py). The loop, the node context, save/resume and the metrics reduction
are the same code. What a worker builds before its first step (its data, engines and streams)
is runtime/worker_build.py; it first resumes from a checkpoint when `trainer.resume` finds one
(runtime/worker_checkpoint.py).

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
from dagrl.dag.planner import Task
from dagrl.data.batch import Batch
from dagrl.data.buffer import balance, reshard
from dagrl.data.replicas import from_replicas, to_replicas
from dagrl.device import is_host
from dagrl.engines.head_stats import release_workspace
from dagrl.engines.host_memory import release_freed_memory
from dagrl.engines.weight_channel import WeightSender
from dagrl.observe.loggers import GENERATIONS_FILE, RunLogger, append_generations
from dagrl.observe.memory import host_rss_bytes
from dagrl.observe.metrics import StepMetrics
from dagrl.observe.observer import StepObserver
from dagrl.roles.multi_model import PrefixedMetrics, merge_view, model_view, prefix_of
from dagrl.roles.plan import plan_with_sides
from dagrl.roles.registry import ROLES, NodeContext
from dagrl.rollout import rollout_backend
from dagrl.runtime.checkpoint import Checkpointer, CheckpointError
from dagrl.runtime.distributed import DistContext, create_layout_groups, position_in_replica
from dagrl.runtime.failures import append_run_log
from dagrl.runtime.preflight import check_cpu_threads, check_mixed_precision
from dagrl.runtime.sides import Placement, place
from dagrl.runtime.validation import Validator
from dagrl.runtime.worker_build import WorkerBuild, check_rollout_on_every_rank
from dagrl.runtime.worker_checkpoint import CheckpointedWorker


def _fingerprint(batch: Batch) -> tuple:
    """What identifies a replica's samples: their number and group ids."""
    return (len(batch), tuple(batch["uid"]) if "uid" in batch else ())


class Worker(WorkerBuild, CheckpointedWorker):
    """One rank's worker, sync or async alike. `cfg` must be resolved (see launch.prepare_run);
    `dist_ctx` says which rank this is (default: a single worker on the host)."""

    def __init__(self, cfg: Config, dist_ctx: DistContext | None = None) -> None:
        self.dist = dist_ctx or DistContext()
        runtime_rss = host_rss_bytes()   # Python, torch, transformers: before any model
        self.cfg, self.run_dir = cfg, Path(cfg.trainer.run_dir)
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        t = cfg.trainer
        if t.torch_threads:
            torch.set_num_threads(t.torch_threads)
        torch.manual_seed(t.seed)
        self.device = self.dist.device
        self.trim_host_memory = t.trim_host_memory and is_host(self.device)
        self.graph, self.order, plans, sides = plan_with_sides(cfg, self.world_size)
        create_layout_groups(self.dist, plans)
        # Which ranks this one steps with, and its tasks (runtime/sides.py): collective.
        self.placement: Placement = place(self.dist, plans, sides)
        self.plan = plans[self.rank]
        self.side, self.tasks = self.placement.side, self.placement.tasks
        if self.placement.kind == "trainer" and t.async_trainer_threads:
            torch.set_num_threads(t.async_trainer_threads)
        self.is_lead = self.rank == self.side.lead and self.placement.trains
        # The ranks that train validate (async: the trainer side, with a rollout engine of its
        # own), each its share of the test split.
        validates = cfg.validates and self.placement.trains
        if (t.val_every or t.val_before_train) and not cfg.data.val_files:
            self.log("validation off: data.val_files is empty (trainer.val_every="
                     f"{t.val_every}, val_before_train={t.val_before_train} not used)")
        needed = self.engines_needed(cfg, "")
        if validates:
            needed |= {"rollout", "reward"}
        joins = rollout_backend(cfg).joins_process_group and self.world_size > 1
        if joins and self.placement.kind == "all" and not validates:
            check_rollout_on_every_rank(plans, cfg.rollout.backend)
        # The data first: a bad file is reported before minutes of model loading.
        tokenizer, self.loader, val_source = self._open_data(validates)
        if is_host(self.device):
            check_cpu_threads(t.torch_threads, self.dist.local_world_size, self.log,
                              async_trainer_threads=t.async_trainer_threads)
        check_mixed_precision(cfg.model.mixed_precision, self.device, self.log)
        if cfg.actor.activation_checkpointing == "auto":
            self.cfg = cfg = self._choose_checkpointing(cfg, needed, runtime_rss)
        self._build_engines(needed, tokenizer)
        if self.loader is not None and self.loader.dropped_per_epoch:
            self.log(f"data: {self.loader.dropped_per_epoch} prompt(s) per epoch do not fill a "
                     f"batch of {cfg.data.train_batch_size} and are dropped (data.tail=drop)")
        self.validator = (Validator(cfg, val_source, self.engines, self.side.index,
                                    self.side.size, self.device,
                                    ranks_per_engine=rollout_backend(cfg).ranks_per_engine(cfg))
                          if validates else None)
        self.checkpoint_root = Path(t.checkpoint_dir or self.run_dir / "checkpoints")
        # The ranks that hold the trained models checkpoint them (async: the trainer side).
        trainers = self.side if self.placement.trains else self.placement.peer
        self.checkpointer = Checkpointer(self.checkpoint_root, rank=trainers.index,
                                         keep_last=t.keep_last, barrier=trainers.barrier,
                                         broadcast=trainers.broadcast, all_ok=trainers.all_true,
                                         process_group=trainers.group)
        estimate = self._estimate_memory(needed, runtime_rss)
        # Per-task timing, memory, FLOPs and the profiler (dagrl/observe/observer.py).
        self.observer = StepObserver(cfg, self.graph, self.engines, self.rank, self.side.size,
                                     self.device, estimated_peak_gb=estimate or None)
        self._open_streams()
        self.logger: RunLogger | None = None   # the lead's, created when training starts
        self.resumed_from: Path | None = None  # the checkpoint resume() loaded
        self._replicated: tuple = ()   # the training layout's samples when last balanced

    def policy_engines(self) -> list:
        """Each trained policy's engines: the main one, then each of `models`, in order."""
        return [self.engines, *self.model_engines.values()]

    def log(self, message: str) -> None:
        if self.is_lead:
            print(f"[dagrl] {message}", flush=True)

    def log_event(self, message: str) -> None:
        """A message that also belongs in the run's log (dagrl.log): checkpoint fallbacks."""
        self.log(message)
        if self.is_lead:
            append_run_log(self.run_dir, message)

    def run_step(self, step: int) -> dict[str, float] | None:
        """One step of this rank's placement, sync or async alike: the source's batch through
        this rank's tasks into the sink. Returns the step's metrics reduced over the side's
        ranks (None on an async rollout rank: they travel with its groups)."""
        metrics = StepMetrics()
        began = time.perf_counter()
        batch = self.source.next_batch(step, metrics)
        batch = self.run_tasks(self.tasks, batch, step, metrics)
        self.observer.profiler.end_step(step)
        if self.placement.trains:
            # A replica's samples count once, not on each of its ranks.
            metrics.add_sum("batch/samples", len(batch)
                            if not self.tasks or self._leads(self.tasks[-1]) else 0)
        return self.sink.finish(step, batch, metrics, time.perf_counter() - began)

    def run_tasks(self, tasks: tuple[Task, ...], batch: Batch, step: int,
                  metrics: StepMetrics) -> Batch:
        """Run `tasks` (the placement's, or a prefix of them) on `batch`: the worker loop. A
        node task calls its role; reshard and balance move samples between ranks."""
        most = len(batch)
        for i, task in enumerate(tasks):
            # The ranks of a replica compute the same node metrics: they count once.
            sink = StepMetrics() if task.group > 1 else metrics
            with self.observer.measure(step, task, metrics):
                if task.kind == "reshard":
                    batch = reshard(batch, task.src, task.dst, device=self.device)
                elif task.kind == "replicate":
                    batch = self._replicate(batch, task)
                elif task.kind == "unreplicate":
                    batch = from_replicas(batch, task.group, self._position(task))
                elif task.kind == "balance" and task.group > 1:
                    batch = self._rebalance_replicas(batch, task)
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
                    release_workspace()
                    release_freed_memory()
            if not task.model:   # FLOPs are counted for the main policy's model only
                self.observer.count_flops(task, batch, sink)
            if sink is not metrics and self._leads(task):
                metrics.merge(sink)
            most = max(most, len(batch))
        # The most samples this rank held at any point: no rank should ever hold the global batch.
        metrics.add_max("batch/max_samples_per_rank", most)
        return batch

    def _replicate(self, batch: Batch, task: Task) -> Batch:
        """Into the training layout over task.dst (data/replicas.py); remembers what each
        replica got, so a balance before the update can tell whether anything changed since."""
        batch = to_replicas(batch, task.group,
                            self.dist.replicas_of(task.dst, task.group).replica_group,
                            self.dist.group_for(task.dst), device=self.device)
        self._replicated = _fingerprint(batch)
        return batch

    def _rebalance_replicas(self, batch: Batch, task: Task) -> Batch:
        """A balance in the training layout: back to shards and into balanced replicas again,
        unless no replica's samples changed since they were balanced (one flag all-reduce over
        the layout's ranks: the side's)."""
        changed = torch.tensor([float(_fingerprint(batch) != self._replicated)])
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.side.cpu_group)
        if not changed.item():
            return batch
        return self._replicate(from_replicas(batch, task.group, self._position(task)), task)

    def _position(self, task: Task) -> int:
        """This rank's position in its replica of the layout `task` runs in (0: sharded)."""
        return position_in_replica(self.rank, task.dst, task.group)

    def _leads(self, task: Task) -> bool:
        """Whether this rank's node metrics and samples count in the layout `task` runs in:
        the ranks of a replica compute the same numbers, the first one's count."""
        return task.group == 1 or self._position(task) == 0

    def node_context(self, task: Task, step: int, metrics: StepMetrics,
                     upstream: tuple[Task, ...],
                     step_metrics: StepMetrics | None = None) -> NodeContext:
        """`metrics`: where the node records; `step_metrics`: where the upstream tasks that
        `ctx.more()` runs again record (default: the same). A node of an extra policy (`model`)
        gets that policy's config and engines, and its metrics get the policy's prefix."""
        again = metrics if step_metrics is None else step_metrics
        # In the training layout a sum over the replicas counts each sample once: over the
        # ranks at this rank's position in every replica.
        group = (self.dist.replicas_of(task.dst, task.group).peer_group if task.group > 1
                 else self.dist.group_for(task.dst))
        m = task.model
        return NodeContext(model_config(self.cfg, m), self.graph.node(task.node_id), step,
                           self.rank, self.world_size,
                           self.model_engines[m] if m else self.engines,
                           PrefixedMetrics(metrics, prefix_of(m)) if m else metrics,
                           reduce_sum=self._reducer(group),
                           more=(lambda: self.run_tasks(upstream, self.source.more(), step, again))
                           if self.source.can_give_more else None,
                           next_prompts=(lambda: self.source.next_prompts(step))
                           if self.source.generates_ahead and self.cfg.rollout.multi_turn.look_ahead
                           else None,
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
        """Resume if a checkpoint is found, then run to trainer.total_steps. Returns the
        metrics of the steps run by this call (the same list on every rank)."""
        t = self.cfg.trainer
        start, position = self.resume() if self.placement.trains else (0, None)
        if self.placement.kind != "all":   # the trainer's lead tells the rollout ranks
            trainer_lead = (self.side if self.placement.trains else self.placement.peer).lead
            start, position = self.dist.broadcast_object((start, position), src=trainer_lead)
        history: list[dict[str, float]] = []
        if start < t.total_steps:
            try:
                self.source.begin(start, position)
            except ValueError as err:   # another dataset or batch size than the checkpoint's
                raise CheckpointError(f"checkpoint {self.resumed_from}: {err}") from err
            self._publish_weights(start)
            history = self._steps(start)
            self.sink.end()
            self.source.end()
            for engines in self.policy_engines():
                if engines.weight_sink is not None:
                    engines.weight_sink.flush()
        self.observer.profiler.merge(self.dist.cpu_group, self.dist.distributed)
        if self.placement.kind != "all":   # an async rollout rank returns the trainer's record
            history = self.dist.broadcast_object(history, src=trainer_lead)
        return history

    def _steps(self, start: int) -> list[dict[str, float]]:
        t = self.cfg.trainer
        if self.is_lead:
            self.logger = RunLogger(self.cfg.logging, self.run_dir, t.total_steps,
                                    start_step=start)
        history = []
        try:
            if t.val_before_train and start == 0 and self.validator is not None:
                self._log(0, self.validate(0))
            for step in range(start + 1, t.total_steps + 1):
                metrics = self.run_step(step)
                if metrics is None:   # an async rollout rank: its metrics went with its groups
                    continue
                last = step == t.total_steps
                if t.val_every and self.validator is not None and (
                        step % t.val_every == 0 or last):
                    metrics.update(self.validate(step))
                history.append(metrics)
                self._log(step, metrics)
                # After a step that finished cleanly: a step that raised (a NaN loss, say)
                # never reaches this, so the previous checkpoint stays the newest.
                if (t.save_every and step % t.save_every == 0) or (last and t.save_final):
                    self.save_checkpoint(step)
        finally:
            if self.logger is not None:
                self.logger.close()
        return history

    def _publish_weights(self, start: int) -> None:
        """The rollout engines start from the actor's weights: an async trainer side sends them
        (with their layout) to the rollout ranks; after a resume, the sync engines take the
        checkpoint's (they were built from the initial weights)."""
        for e in self.policy_engines():   # policy after policy, as the rollout ranks receive
            if isinstance(e.weight_sink, WeightSender):
                e.weight_sink.send_first(e.actor.full_weights(), start)
                e.synced_version = e.actor.version
            elif start > 0 and self.placement.kind == "all":
                e.synced_version = -1
                e.sync_rollout_weights()

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def validate(self, step: int) -> dict[str, float]:
        """Every rank of the side scores its share of the test split with the current weights
        (an async trainer side too: its own rollout engine, refreshed here)."""
        self.engines.refresh_own_rollout()
        metrics = self.validator.run()
        if self.validator.samples:      # rank 0, logging.val_generations > 0
            append_generations(self.run_dir / GENERATIONS_FILE, step, self.validator.samples)
        return metrics.reduce(self.side.cpu_group)
