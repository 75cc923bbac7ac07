"""The worker of trainer.mode=async: the same process on every rank, two loops by side.

Setup is collective (every rank, in the same order): plan the graph on its two sides
(dag/async_placement.py), create the process groups, build this side's engines only (rollout
ranks: rollout engine, reward manager and the reference when ref_logprob is placed there, sharded
over the rollout ranks; trainer ranks: actor, critic, sharded over the trainer ranks alone),
resume on the trainer ranks and tell the rollout ranks where the data continues, and send the
first weights. Then the sides part (runtime/async_loops.py):

    rollout ranks   for each step: wait until the weights are at most max_staleness versions
                    old, read this rank's prompts, run the rollout side (rollout, reward, ref),
                    push the scored groups into the buffer (data/async_buffer.py)
    trainer ranks   for each step: pull the batch, run the trainer side (old_logprob, ...,
                    actor_update, whose weight sync sends the new weights to the rollout ranks
                    in the background: engines/weight_channel.py), reduce and log the metrics,
                    checkpoint

and meet again only at the end. Checkpoints hold the trainer's state and the position of the
data the trainer has consumed: the groups in flight (generated, not yet trained on) are not
saved, and a resumed run generates them again from the same prompts with the checkpoint's
weights — no prompt is trained on twice or skipped (docs/async.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from dagrl.config.schema import Config
from dagrl.dag.planner import Task
from dagrl.data.dataset import ParquetPrompts, PromptLoader
from dagrl.device import HOST_BACKEND, is_host
from dagrl.engines.bundle import build_engines
from dagrl.engines.models import DTYPES, load_tokenizer
from dagrl.observe.loggers import RunLogger, truncate_jsonl
from dagrl.observe.observer import StepObserver
from dagrl.roles.plan import plan_with_sides
from dagrl.roles.registry import ROLES
from dagrl.runtime.async_loops import RolloutLoop, TrainerLoop
from dagrl.runtime.checkpoint import Checkpointer, CheckpointError, Stateful, resolve_resume
from dagrl.runtime.distributed import DistContext, create_layout_groups
from dagrl.runtime.failures import append_run_log
from dagrl.runtime.preflight import check_cpu_threads, check_prompts


class SideGroup:
    """Collectives over one side's ranks (global rank numbers in, like DistContext's)."""

    def __init__(self, ranks: tuple[int, ...], group: dist.ProcessGroup,
                 cpu_group: dist.ProcessGroup, rank: int) -> None:
        self.ranks, self.group, self.cpu_group = ranks, group, cpu_group
        self.index = ranks.index(rank) if rank in ranks else -1
        self.size = len(ranks)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def broadcast(self, obj):
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.cpu_group)
        return box[0]

    def all_true(self, ok: bool) -> bool:
        if self.size == 1:
            return ok
        t = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return float(t.item()) == 0.0


class AsyncWorker:
    """One rank of an async run. `cfg` resolved (launch.prepare_run); several workers."""

    def __init__(self, cfg: Config, dist_ctx: DistContext) -> None:
        self.dist, self.cfg = dist_ctx, cfg
        self.rank, self.world_size = dist_ctx.rank, dist_ctx.world_size
        self.run_dir = Path(cfg.trainer.run_dir)
        t = cfg.trainer
        if t.torch_threads:
            torch.set_num_threads(t.torch_threads)
        torch.manual_seed(t.seed)
        self.device = dist_ctx.device
        self.graph, self.order, plans, self.sides = plan_with_sides(cfg, self.world_size)
        create_layout_groups(dist_ctx, plans)   # collective: the two sides' groups
        s = self.sides
        cpu = {}
        for ranks in (s.trainer_ranks, s.rollout_ranks):   # every rank, in the same order
            cpu[ranks] = (dist.new_group(list(ranks), backend=HOST_BACKEND)
                          if not is_host(self.device) else dist_ctx.group_for(ranks))
        self.trainer = SideGroup(s.trainer_ranks, dist_ctx.group_for(s.trainer_ranks),
                                 cpu[s.trainer_ranks], self.rank)
        self.rollout = SideGroup(s.rollout_ranks, dist_ctx.group_for(s.rollout_ranks),
                                 cpu[s.rollout_ranks], self.rank)
        self.is_trainer = self.rank in s.trainer_ranks
        self.is_lead = self.rank == s.trainer_ranks[0]   # logs, commits checkpoints
        mine = s.trainer_nodes if self.is_trainer else s.rollout_nodes
        self.tasks = self._side_tasks(plans[self.rank].tasks, set(mine))
        side = self.trainer if self.is_trainer else self.rollout
        if self.is_trainer and cfg.actor.mini_batch_size % side.size:
            raise ValueError(f"actor.mini_batch_size ({cfg.actor.mini_batch_size}) must be "
                             f"divisible by the {side.size} trainer ranks")
        needed = {e for n in mine for e in ROLES.get(self.graph.node(n).role).engines}
        # The rollout side generates with its own copy, scores and (when placed there) runs the
        # frozen reference; the trainer side trains.
        needed = (needed & {"rollout", "reward", "ref"} if not self.is_trainer
                  else needed - {"rollout"})
        d = cfg.data
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.gguf_file)
        self.loader = None
        if not self.is_trainer:   # only the rollout ranks read prompts
            self.loader = PromptLoader(
                ParquetPrompts(d.train_files, d.prompt_key), tokenizer,
                batch_size=d.train_batch_size, rank=side.index, world_size=side.size,
                seed=t.seed, shuffle=d.shuffle, tail=d.tail,
                max_prompt_length=d.max_prompt_length, truncation=d.truncation)
            check_prompts({"train": self.loader}, self.log)
        if is_host(self.device):
            check_cpu_threads(t.torch_threads, self.dist.local_world_size, self.log)
        self.engines = build_engines(cfg, needed, self.device, world_size=side.size,
                                     log=self.log, tokenizer=tokenizer,
                                     dp_group=side.group)   # this side's ranks shard
        self.checkpoint_root = Path(t.checkpoint_dir or self.run_dir / "checkpoints")
        self.checkpointer = Checkpointer(
            self.checkpoint_root, rank=self.trainer.index, keep_last=t.keep_last,
            barrier=self.trainer.barrier, broadcast=self.trainer.broadcast,
            all_ok=self.trainer.all_true, process_group=self.trainer.group)
        self.observer = StepObserver(cfg, self.graph, self.engines, side.index, side.size,
                                     self.device, side.cpu_group)
        self.wire_dtype = DTYPES[cfg.model.rollout_dtype]

    @staticmethod
    def _side_tasks(tasks: tuple[Task, ...], nodes: set[str]) -> tuple[Task, ...]:
        """This side's node and balance tasks; the reshards in and out of the rollout side are
        the dataloader and the async buffer."""
        return tuple(t for t in tasks if t.kind != "reshard" and t.node_id in nodes)

    def log(self, message: str) -> None:
        if self.is_lead:
            print(f"[dagrl] {message}", flush=True)

    def log_event(self, message: str) -> None:
        self.log(message)
        if self.is_lead:
            append_run_log(self.run_dir, message)

    # --- the run -----------------------------------------------------------------------------
    def train(self) -> list[dict[str, float]]:
        """Resume, then run this rank's side to trainer.total_steps. Returns the per-step
        metrics (the same list on every rank)."""
        t = self.cfg.trainer
        start, loader_state = self.resume() if self.is_trainer else (0, None)
        start, loader_state = self.dist.broadcast_object((start, loader_state),
                                                         src=self.trainer.ranks[0])
        history: list[dict[str, float]] = []
        if start < t.total_steps:
            if self.is_trainer:
                history = self._train_side(start, loader_state)
            else:
                if loader_state is not None:
                    self.loader.load_state_dict(loader_state)
                RolloutLoop(self, start).run()
        # Rank 0 may be a rollout rank: every rank returns the trainer's record.
        return self.dist.broadcast_object(history, src=self.trainer.ranks[0])

    def _train_side(self, start: int, loader_state: dict | None) -> list[dict[str, float]]:
        logger = None
        if self.is_lead:
            logger = RunLogger(self.cfg.logging, self.run_dir, self.cfg.trainer.total_steps,
                               start_step=start)
        try:
            return TrainerLoop(self, start, loader_state, logger).run()
        finally:
            if logger is not None:
                logger.close()

    # --- checkpoints (trainer ranks) ---------------------------------------------------------
    def stateful_engines(self) -> dict[str, Stateful]:
        out = {}
        for name in ("actor", "critic"):
            engine = getattr(self.engines, name)
            if engine is not None:
                out[name] = Stateful(engine.model, engine.optimizer, engine.scheduler)
        return out

    def save_checkpoint(self, step: int, loader_state: dict) -> Path:
        e = self.engines
        state = {"loader": loader_state, "world_size": self.world_size,
                 "versions": {name: getattr(e, name).version for name in self.stateful_engines()},
                 "kl_controller": e.kl_controller.state_dict() if e.kl_controller else None,
                 # What a resume does with the groups generated but not yet trained on.
                 "async": {"trainer_ranks": list(self.trainer.ranks),
                           "in_flight_groups": "regenerated"}}
        start = time.perf_counter()
        path = self.checkpointer.save(step, self.stateful_engines(), state,
                                      hf_files=self.engines.write_hf_files)
        self.log(f"checkpoint: step {step} -> {path} ({time.perf_counter() - start:.1f} s)")
        return path

    def resume(self) -> tuple[int, dict | None]:
        """The checkpoint `trainer.resume` selects: (its step, the data position), or (0, None)."""
        resume = self.cfg.trainer.resume
        if resume == "auto":
            found = self.checkpointer.load_newest(self.stateful_engines(), self.log_event)
            if found is None:
                return 0, None
            path, state = found
        else:
            path = resolve_resume(resume, self.checkpoint_root)
            if path is None:
                return 0, None
            state = self.checkpointer.load(path, self.stateful_engines())
        e = self.engines
        for name, version in state["versions"].items():
            getattr(e, name).version = version
        if e.kl_controller is not None and state["kl_controller"] is not None:
            e.kl_controller.load_state_dict(state["kl_controller"])
        step = int(state["step"])
        if not isinstance(state.get("loader"), dict):
            raise CheckpointError(f"checkpoint {path}: no dataloader position")
        if self.is_lead:
            truncate_jsonl(self.run_dir / "metrics.jsonl", step)
        self.log(f"resumed from {path} (step {step}, saved by {state['world_size']} worker(s), "
                 f"now {self.world_size}; the groups in flight then are generated again)")
        return step, state["loader"]
