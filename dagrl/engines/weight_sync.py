"""Full weights of a sharded model (FSDP2, or FSDP2 x tensor parallel), gathered in buckets.

`param.full_tensor()` costs one collective per parameter (two on a 2-D mesh): a few hundred
small collectives for a real model, each paying the collective's latency. Here the local shards
of many parameters are packed into one flat buffer per bucket and gathered with a single
`all_gather_single` per mesh dimension (the CANN team's finding for verl: gather inside
each dimension's group per bucket, never per parameter):

    1. over the FSDP (dp) group: every rank's rows of its tensor-parallel slice -> the slice
    2. over the tp group (tensor-parallel parameters only): the slices -> the whole parameter

then each full parameter is cut out of the gathered buffer. Parameters a layout replicates over
tp (norms, KV heads fewer than ranks) are gathered over dp alone, in their own buckets. Under
HSDP (trainer.fsdp_shard_size; the mesh's first dim is `replicate`) the FSDP group of step 1 is
the rank's shard group: each group holds a whole copy (of each tp slice), so nothing is
gathered across the groups. At most
one bucket's gathered buffers are alive at a time, and each full tensor only until its consumer
(the rollout engine's in-place copy) has taken it. A rank receives each byte of the model it
lacks once, plus the padding of uneven shards (at most one bucket's worth).

FSDP2 shards every parameter (or its tensor-parallel slice) on dim 0 the way `torch.chunk`
does: rank r holds rows [r*c, (r+1)*c) with c = ceil(rows / world), so the last ranks may hold
fewer rows or none; tensor parallelism splits its dim (0 or 1) the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

# Bytes of full parameters per bucket: few collectives, bounded transient memory.
BUCKET_BYTES = 128 * 2**20


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of dim 0 held by each rank under FSDP2's (torch.chunk) sharding."""
    per = -(-rows // world) if rows else 0
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def _layout(p: torch.Tensor) -> tuple | None:
    """How a parameter is split, as (kind, base[, tp dim]): None for a plain (whole) tensor;
    ("dp", b) for FSDP2 rows over mesh dim b; ("tp", b, dim) for FSDP2 rows of a tp slice on
    `dim` over mesh dim b, the slices over dim b + 1; ("rep", b) for FSDP2 rows of a parameter
    tp replicates; ("other",) for anything else (gathered alone). b is 1 under HSDP (the mesh's
    dim 0 replicates whole copies: the gathers stay inside the shard group), else 0."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not hasattr(p, "placements"):
        return None
    placements = tuple(p.placements)
    base = int(len(placements) > 1 and placements[0] == Replicate()
               and p.device_mesh.mesh_dim_names[0] == "replicate")
    rest = placements[base:]
    dp_rows = rest and (rest[0] == Shard(0) or (
        isinstance(rest[0], _StridedShard) and rest[0].dim == 0))
    if p.dim() == 0 or not dp_rows:
        return ("other",)
    if len(rest) == 1:
        return ("dp", base)
    if len(rest) == 2 and rest[1] == Replicate():
        return ("rep", base)
    if len(rest) == 2 and isinstance(rest[1], Shard) and not isinstance(rest[1], _StridedShard):
        return ("tp", base, rest[1].dim)
    return ("other",)


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
def gather_full_weights(model: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES,
                        select: Callable[[str], bool] | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter of `model` (those whose name `select` takes):
    whole ones first, then bucket by bucket (tensor-parallel and replicated parameters in
    separate buckets, each in `named_parameters` order). A collective over the model's mesh:
    every rank must consume the iterator. Under HSDP each shard group holds a whole copy: the
    gathers stay inside the rank's group, never across the replicas."""
    _reshard(model)
    params = [(name, p) for name, p in model.named_parameters()
              if select is None or select(name)]
    # Buckets by (kind, base): "dp" (FSDP2 rows over mesh dim base; parameters tp replicates
    # too), "tp" (rows of a tp slice over dim base, then the slices over dim base + 1).
    kinds: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
    for name, p in params:
        layout = _layout(p)
        if layout is None:
            yield name, p.detach()
        elif layout == ("other",):
            yield name, p.full_tensor()
        else:
            kind = "tp" if layout[0] == "tp" else "dp"
            kinds.setdefault((kind, layout[1]), []).append((name, p))
    for (kind, base), members in kinds.items():
        for bucket in _buckets(members, bucket_bytes):
            yield from _gather_bucket(bucket, base, kind == "tp")


def _reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 unit of `model` back to its shards. FSDP2 keeps the root's parameters
    gathered after a forward, for the backward it expects; after a forward without one (the
    reference pass of a LoRA actor) they are registered whole, on the tp mesh alone under
    tensor parallelism, which the layouts above would misread as FSDP2 rows."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _gather_flat(pieces: list[torch.Tensor], counts: list[list[int]],
                 group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """One all-gather of this rank's `pieces` (flattened end to end, padded to the largest
    rank's total): counts[i][k] = elements of piece i on group rank k. Returns, per piece,
    the flat pieces of every group rank, in rank order."""
    world = dist.get_world_size(group)
    per_rank = [sum(c[k] for c in counts) for k in range(world)]
    width = max(per_rank)
    send = pieces[0].new_zeros(width)
    torch.cat([t.reshape(-1) for t in pieces], out=send[:sum(t.numel() for t in pieces)])
    gathered = send.new_empty(world * width)                      # [world x width]
    dist.all_gather_single(gathered, send, group=group)
    segments = gathered.view(world, width)
    out, offsets = [], [0] * world
    for c in counts:
        parts = []
        for k in range(world):
            parts.append(segments[k, offsets[k]:offsets[k] + c[k]])
            offsets[k] += c[k]
        out.append(parts)
    return out


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], base: int, tensor_parallel: bool,
                   *, slices_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole parameter) of each in `bucket`; `slices_only`: of tensor-parallel ones,
    this rank's tp slice (the first step alone: rollout_shards.py)."""
    mesh = bucket[0][1].device_mesh
    # The ranks FSDP2 shards the rows over: mesh dim `base` (under HSDP the shard group: each
    # group holds a whole copy, so the gather never leaves it); the tp slices: dim base + 1.
    dp_group = mesh.get_group(base)
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    tp_dim = base + 1
    tp, tp_rank = (mesh.size(tp_dim), mesh.get_local_rank(tp_dim)) if tensor_parallel else (1, 0)
    # The tp slice each parameter's FSDP shards cut up: its shape on every tp rank.
    slices = []
    for _, p in bucket:
        if tensor_parallel:
            dim = p.placements[tp_dim].dim
            sizes = shard_rows(p.shape[dim], tp)
            slices.append([p.shape[:dim] + (s,) + p.shape[dim + 1:] for s in sizes])
        else:
            slices.append([tuple(p.shape)])
    local = [p.to_local() for _, p in bucket]
    # 1. over dp: rows of my tp slice -> the slice.
    rows = [shard_rows(s[tp_rank][0], dp) for s in slices]
    row_numel = [math.prod(s[tp_rank][1:]) for s in slices]
    for (name, _), shard, r, n in zip(bucket, local, rows, row_numel, strict=True):
        if shard.numel() != r[dp_rank] * n:   # a layout other than torch.chunk rows: do not guess
            raise RuntimeError(f"weight sync: rank {dp_rank} holds {shard.numel()} elements of "
                               f"{name!r}, expected {r[dp_rank] * n} (dim-0 chunks of {r})")
    if dp > 1:
        parts = _gather_flat(local, [[x * n for x in r] for r, n in zip(rows, row_numel,
                                                                      strict=True)], dp_group)
        mine = [torch.cat(pieces).view(s[tp_rank]) for pieces, s in zip(parts, slices,
                                                                        strict=True)]
    else:
        mine = [t.view(s[tp_rank]) for t, s in zip(local, slices, strict=True)]
    if not tensor_parallel or slices_only:
        for (name, _), full in zip(bucket, mine, strict=True):
            yield name, full
        return
    # 2. over tp: the slices -> the whole parameter, concatenated on its tp dim.
    counts = [[math.prod(shape) for shape in s] for s in slices]
    parts = _gather_flat(mine, counts, mesh.get_group(tp_dim))
    for (name, p), pieces, s in zip(bucket, parts, slices, strict=True):
        dim = p.placements[tp_dim].dim
        yield name, torch.cat([x.view(shape) for x, shape in zip(pieces, s, strict=True)], dim)
