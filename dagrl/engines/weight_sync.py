"""Full weights of an FSDP2-sharded model, gathered in buckets.

`param.full_tensor()` costs one all-gather per parameter: a few hundred small collectives for a
real model, each paying the collective's latency. Here the local shards of many parameters
are packed into one flat buffer per bucket and gathered with a single `all_gather_into_tensor`;
then each full parameter is cut out of the gathered buffer. At most one bucket's gathered
buffer (world_size x the bucket's largest shard) is alive at a time, and each full tensor only
until its consumer (the rollout engine's in-place copy) has taken it.

FSDP2 shards every parameter on dim 0 the way `torch.chunk` does: rank r holds rows
[r*c, (r+1)*c) with c = ceil(rows / world), so the last ranks may hold fewer rows or none.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

# Bytes of full parameters per bucket: few collectives, bounded transient memory.
BUCKET_BYTES = 128 * 2**20


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of dim 0 held by each rank under FSDP2's (torch.chunk) sharding."""
    per = -(-rows // world) if rows else 0
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def _buckets(params: list[tuple[str, torch.Tensor]], limit: int):
    bucket, size = [], 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        if bucket and (size + nbytes > limit or p.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def gather_full_weights(model: torch.nn.Module,
                        bucket_bytes: int = BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter of `model`, in `named_parameters` order. A
    collective over the model's data-parallel group: every rank must consume the iterator."""
    params = list(model.named_parameters())
    sharded = [(n, p) for n, p in params if _row_sharded(p)]
    buckets = _buckets(sharded, bucket_bytes)
    pending: dict[str, torch.Tensor] = {}
    for name, p in params:
        if not hasattr(p, "to_local"):          # a plain tensor: already whole
            yield name, p.detach()
        elif not _row_sharded(p):               # another DTensor layout: gather it alone
            yield name, p.full_tensor()
        else:
            if name not in pending:             # the next bucket starts with this parameter
                pending = dict(_gather_bucket(next(buckets)))
            yield name, pending.pop(name)


def _row_sharded(p: torch.Tensor) -> bool:
    """FSDP2's layout: a DTensor sharded on dim 0 over a 1-D mesh, or (HSDP) replicated over
    the first dimension of a 2-D mesh and sharded on dim 0 over the second."""
    from torch.distributed.tensor import Replicate, Shard

    return (hasattr(p, "placements") and p.dim() > 0
            and tuple(p.placements) in ((Shard(0),), (Replicate(), Shard(0))))


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    # The ranks a parameter is sharded over (HSDP: its shard group; each group holds a whole
    # copy, so the gather never leaves it).
    mesh = bucket[0][1].device_mesh
    group = mesh.get_group(mesh.ndim - 1)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = [p.to_local() for _, p in bucket]
    # Per parameter: rows held by each rank and the elements in one row.
    rows = [shard_rows(p.shape[0], world) for _, p in bucket]
    row_numel = [math.prod(p.shape[1:]) for _, p in bucket]
    per_rank = [sum(r[k] * n for r, n in zip(rows, row_numel, strict=True)) for k in range(world)]
    width = max(per_rank)
    send = local[0].new_zeros(width)
    offset = 0
    for (name, _), shard, r, n in zip(bucket, local, rows, row_numel, strict=True):
        if shard.numel() != r[rank] * n:   # a layout other than torch.chunk rows: do not guess
            raise RuntimeError(f"weight sync: rank {rank} holds {shard.numel()} elements of "
                               f"{name!r}, expected {r[rank] * n} (dim-0 chunks of {r})")
        send[offset:offset + shard.numel()] = shard.reshape(-1)
        offset += shard.numel()
    gathered = send.new_empty(world * width)                      # [world x width]
    dist.all_gather_into_tensor(gathered, send, group=group)
    segments = gathered.view(world, width)
    offsets = [0] * world
    for (name, p), r, n in zip(bucket, rows, row_numel, strict=True):
        pieces = []
        for k in range(world):
            count = r[k] * n
            pieces.append(segments[k, offsets[k]:offsets[k] + count])
            offsets[k] += count
        yield name, torch.cat(pieces).view(p.shape)
