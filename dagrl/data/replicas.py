"""Moves into and out of the replicated (training) layout under tensor / sequence parallelism.

The training ranks (all W of them, or an async trainer side's W) form W / g data-parallel
replicas of g consecutive ranks (the layout's r-th rank is rank r mod g of replica r // g); the
ranks of a replica run one model together, so each must hold every sample of its replica, in
the same order.

- `to_replicas(batch, g)`: from any sharded layout. Whole groups are assigned to replicas by
  `balanced_partition` of their tokens (equal group counts, similar tokens), and each replica's
  groups are spread in contiguous runs over its g ranks: one `exchange` (all_to_all), so a
  sample crosses the network once. Then each replica all-gathers its ranks' shares: every rank
  receives the other g - 1 shares, each sample exactly once.
- `from_replicas(batch, g)`: back to a sharded layout over all ranks: rank i of a replica keeps
  the i-th contiguous run of 1/g of the replica's groups. Nothing moves.

A group (a prompt's samples, same `uid`) is never split, as in buffer.py.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from dagrl.data.batch import Batch
from dagrl.data.buffer import (
    balanced_partition,
    batch_device,
    exchange,
    group_runs,
    pack,
    sample_tokens,
    unpack,
)
from dagrl.device import HOST


def _runs(count: int, parts: int) -> list[int]:
    """Part of each of `count` items split into `parts` contiguous, near-equal runs."""
    bounds = np.cumsum([0] + [count // parts + (i < count % parts) for i in range(parts)])
    return list(np.searchsorted(bounds, np.arange(count), side="right") - 1)


def to_replicas(batch: Batch, group_size: int, replica_group: dist.ProcessGroup | None,
                layout_group: dist.ProcessGroup | None = None, *,
                device: torch.device | str = HOST) -> Batch:
    """Collective over the layout's ranks (`layout_group`; None: all ranks; see the module
    docstring); `replica_group`: this rank's replica's process group (None: the replica is the
    whole layout)."""
    world = dist.get_world_size(layout_group)
    replicas = world // group_size
    starts = group_runs(batch)
    tokens = sample_tokens(batch).numpy()
    mine = [int(x) for x in np.add.reduceat(tokens, starts)] if len(starts) else []
    gathered: list[list[int]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine, group=layout_group)
    everything = [w for per_rank in gathered for w in per_rank]
    replica_of = balanced_partition(everything, replicas)
    # Within a replica its groups, in global order, go in contiguous runs to its ranks.
    rank_of = [0] * len(everything)
    for d in range(replicas):
        members = [i for i, p in enumerate(replica_of) if p == d]
        for i, part in zip(members, _runs(len(members), group_size), strict=True):
            rank_of[i] = d * group_size + int(part)
    offset = sum(len(g) for g in gathered[:dist.get_rank(layout_group)])
    sizes = np.diff(np.append(starts, len(batch)))
    dest = torch.as_tensor(np.repeat(np.asarray(rank_of[offset:offset + len(mine)],
                                                dtype=np.int64), sizes))
    share = exchange(batch, dest, layout_group, device=device)
    return gather_replica(share, replica_group, device=device)


def gather_replica(batch: Batch, replica_group: dist.ProcessGroup | None, *,
                   device: torch.device | str = HOST) -> Batch:
    """Every rank of the replica ends with all of its ranks' samples, in rank order: sizes
    first, then one all-gather of the packed shares (padded to the largest)."""
    g = dist.get_world_size(replica_group)
    if g == 1:
        return batch
    device = torch.device(device)
    buf = pack(batch, device)
    size = torch.tensor([buf.numel()], dtype=torch.int64, device=device)
    sizes = torch.empty(g, dtype=torch.int64, device=device)
    dist.all_gather_single(sizes, size, group=replica_group)
    sizes = sizes.tolist()
    width = max(sizes)
    send = torch.zeros(width, dtype=torch.uint8, device=device)
    send[:buf.numel()] = buf
    recv = torch.empty(g * width, dtype=torch.uint8, device=device)
    dist.all_gather_single(recv, send, group=replica_group)
    out_device = batch_device(batch, device)
    parts = [unpack(recv[k * width:k * width + n], out_device, copy=False)
             for k, n in enumerate(sizes)]
    non_empty = [p for p in parts if len(p)]
    if not non_empty:
        return batch
    return Batch.concat(non_empty)


def from_replicas(batch: Batch, group_size: int, rank_in_replica: int) -> Batch:
    """This rank's 1/g of its replica's groups (contiguous run `rank_in_replica`); local."""
    starts = group_runs(batch)
    if not len(starts):
        return batch
    parts = np.asarray(_runs(len(starts), group_size))
    sizes = np.diff(np.append(starts, len(batch)))
    keep = np.repeat(parts == rank_in_replica, sizes)
    return batch.select(torch.from_numpy(np.flatnonzero(keep)))

