"""Process-group setup for one worker: the world group, a CPU group, one group per layout, and
the replicas' groups of the replicated layouts (the training layout under tensor / sequence
parallelism, the rollout layout under rollout tensor parallelism).

Whatever started the worker (Ray, torchrun, a test) provides RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT in the environment; this module joins the group with the backend the
device needs. Groups for DAG nodes placed on a subset of ranks are created up front from the
plan, in plan order, because `new_group` is itself collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dagrl.dag.planner import RankPlan
from dagrl.device import (
    HOST_BACKEND,
    collective_backend,
    device_type,
    host_device,
    is_host,
    worker_device,
)


@dataclass(frozen=True)
class Replicas:
    """A replicated layout seen from one of its ranks: replicas of `size` consecutive ranks of
    `ranks`; this rank's replica's process group and its peers' (the rank at its position in
    every replica: a sum over them counts each sample once)."""
    ranks: tuple[int, ...]
    size: int
    replica_group: dist.ProcessGroup | None
    peer_group: dist.ProcessGroup | None


def position_in_replica(rank: int, ranks: tuple[int, ...], size: int) -> int:
    """`rank`'s position in its replica of `size` consecutive ranks of `ranks` (0 outside)."""
    return ranks.index(rank) % size if rank in ranks else 0


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=host_device)
    # Metrics and small Python objects always travel over gloo on the host (None: the world
    # group is already gloo).
    cpu_group: dist.ProcessGroup | None = None
    layout_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    # The replicated layouts (the training layout under tensor / sequence parallelism, the
    # rollout layout under rollout tensor parallelism), by (ranks, ranks per replica).
    replicas: dict[tuple[tuple[int, ...], int], Replicas] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def local_world_size(self) -> int:
        """Workers on this host: torchrun's LOCAL_WORLD_SIZE, else all of them (one host)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def group_for(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of a layout (None = the world group)."""
        if len(ranks) == self.world_size:
            return None
        return self.layout_groups[ranks]

    def replicas_of(self, ranks: tuple[int, ...], size: int) -> Replicas:
        """The replicated layout of `size` consecutive ranks over `ranks` (a plan's replicate
        task's dst and group)."""
        return self.replicas[(tuple(ranks), size)]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.cpu_group)

    def broadcast_object(self, obj, src: int = 0):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]


def env_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from the launcher's environment, or None when absent."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def init_distributed(device_pref: str, timeout_s: float = 1800.0,
                     host_tensors: bool = False) -> DistContext:
    """Join the process group described by the environment (a single process without one).
    `host_tensors`: collectives will see host tensors too (actor.offload / ref.offload)."""
    kind = device_type(device_pref)
    found = env_world()
    if found is None or found[1] == 1:
        return DistContext(device=worker_device(kind, 0))
    rank, world, local_rank = found
    device = worker_device(kind, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(collective_backend(kind, host_tensors), rank=rank,
                                world_size=world,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=None if is_host(device) else device)
    cpu_group = None if is_host(device) else dist.new_group(backend=HOST_BACKEND)
    return DistContext(rank, world, local_rank, device, cpu_group)


def create_layout_groups(ctx: DistContext, plans: list[RankPlan]) -> None:
    """One process group per distinct subset layout in the plan (collective: all ranks call)."""
    if not ctx.distributed:
        return
    layouts = []
    for task in plans[0].tasks:   # every rank's list has the same reshard tasks, in order
        for ranks in (task.src, task.dst):
            if ranks and len(ranks) < ctx.world_size and ranks not in layouts:
                layouts.append(ranks)
    for plan in plans:
        for task in plan.tasks:
            if task.kind == "node" and len(task.dst) < ctx.world_size and task.dst not in layouts:
                layouts.append(task.dst)
    for ranks in layouts:
        ctx.layout_groups[ranks] = dist.new_group(list(ranks))
    # The replicated layouts (training, rollout), from any rank's plan holding them. Creating
    # subgroups is collective: every rank creates every layout's, in plan order.
    layouts = []
    for plan in plans:
        for task in plan.tasks:
            if task.kind == "replicate" and (task.dst, task.group) not in layouts:
                layouts.append((task.dst, task.group))
    for ranks, size in layouts:
        replica_group, _ = dist.new_subgroups_by_enumeration(
            [list(ranks[d:d + size]) for d in range(0, len(ranks), size)])
        peer_group, _ = dist.new_subgroups_by_enumeration(
            [list(ranks[i::size]) for i in range(size)])
        ctx.replicas[(ranks, size)] = Replicas(ranks, size, replica_group, peer_group)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
