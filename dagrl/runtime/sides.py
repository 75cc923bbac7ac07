"""Where a worker's loop runs: the ranks it steps with, and which part of the plan it runs.

A sync run is one placement: every rank runs the whole plan, and its collectives (metrics,
checkpoint agreement) span all ranks. trainer.mode=async is two placements of the same plan
(dag/async_placement.py cuts the graph in two): the rollout ranks run the rollout side's
nodes, the trainer ranks the rest, each side with collectives over its own ranks. Both run the
same `Worker` loop (runtime/worker.py); only the placement, the batch source and the batch sink
differ (runtime/streams.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dagrl.dag.async_placement import AsyncSides
from dagrl.dag.planner import RankPlan, Task
from dagrl.device import HOST_BACKEND, is_host
from dagrl.runtime.distributed import DistContext

# The engines each async side builds: the rollout side generates with its own copy, scores (rule
# scorers, a reward model or a judge) and (when ref_logprob is placed there) runs the frozen
# reference; the trainer side trains.
ROLLOUT_SIDE_ENGINES = frozenset({"rollout", "reward", "reward_model", "judge", "ref"})


@dataclass
class Side:
    """The ranks that step together, with their groups (global rank numbers). `group`: tensor
    collectives (None: the world); `cpu_group`: metrics and Python objects (None: the world's,
    when the world group is gloo already)."""
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    rank: int

    @property
    def index(self) -> int:
        """This rank's position among the side's ranks (-1: not one of them)."""
        return self.ranks.index(self.rank) if self.rank in self.ranks else -1

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def lead(self) -> int:
        """The side's first rank: it logs, and commits checkpoints."""
        return self.ranks[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def broadcast(self, obj):
        """The lead's `obj` on every rank of the side."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.lead, group=self.cpu_group)
        return box[0]

    def max(self, value: float) -> float:
        """The largest of the side's ranks' `value` (collective)."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return float(box.item())

    def all_true(self, ok: bool) -> bool:
        """True on every rank of the side iff every one passed True (collective)."""
        return self.max(0.0 if ok else 1.0) == 0.0


@dataclass
class Placement:
    """What one rank runs: its side (`kind` "all" in sync mode, else "rollout" or "trainer"),
    its tasks, and, in async mode, the other side (the peer its batches or weights go to)."""
    kind: str
    side: Side
    tasks: tuple[Task, ...]
    peer: Side | None = None

    @property
    def reads_prompts(self) -> bool:
        return self.kind != "trainer"

    @property
    def trains(self) -> bool:
        """Holds the trained models: resumes, logs the step's metrics, checkpoints."""
        return self.kind != "rollout"

    def engines(self, needed: set[str]) -> set[str]:
        """Of the engines the plan's nodes use, those this side builds."""
        if self.kind == "rollout":
            return needed & ROLLOUT_SIDE_ENGINES
        if self.kind == "trainer":
            return needed - {"rollout"}
        return needed


def place(ctx: DistContext, plans: list[RankPlan], sides: AsyncSides | None) -> Placement:
    """This rank's placement (collective: every rank calls it, in the same order, since async
    sides create their host groups here)."""
    plan = plans[ctx.rank]
    if sides is None:
        everyone = tuple(range(ctx.world_size))
        side = Side(everyone, None, ctx.cpu_group if ctx.distributed else None, ctx.rank)
        return Placement("all", side, plan.tasks)
    made = {}
    for ranks in (sides.trainer_ranks, sides.rollout_ranks):   # every rank, in the same order
        cpu = (dist.new_group(list(ranks), backend=HOST_BACKEND) if not is_host(ctx.device)
               else ctx.group_for(ranks))
        made[ranks] = Side(ranks, ctx.group_for(ranks), cpu, ctx.rank)
    trainer, rollout = made[sides.trainer_ranks], made[sides.rollout_ranks]
    if ctx.rank in sides.trainer_ranks:
        kind, side, peer, nodes = "trainer", trainer, rollout, set(sides.trainer_nodes)
    else:
        kind, side, peer, nodes = "rollout", rollout, trainer, set(sides.rollout_nodes)
    # The reshard between the sides is the async buffer (runtime/streams.py), not a task.
    tasks = tuple(t for t in plan.tasks if t.kind != "reshard" and t.node_id in nodes)
    return Placement(kind, side, tasks, peer)
