"""Weights from the training shards straight into a tensor-parallel rollout engine's shards.

A rollout engine sharded over `size` consecutive ranks (vLLM at `tensor_parallel_size` > 1)
reads, on its rank t, one block of each weight: the t-th of `size` equal chunks of the dim
it splits (Megatron's layout, which vLLM uses: q/k/v and gate/up by output rows, o/down by
input columns), or the whole tensor for what it keeps whole (norms; k/v when the KV heads do
not split; the embedding and LM head, whose vocabulary vLLM pads to its own shard size). Where
`weight_sync.gather_full_weights` makes every rank hold every whole weight, here each rank
receives only its blocks, bucket by bucket:

- FSDP2 rows over a group G (no training tensor parallelism): **one all-to-all over G per
  bucket**. Rank r holds rows R_r of each weight; it sends rank q the part of R_r inside q's
  block (q's rows, or all of q's columns of R_r). Each rank receives each byte of its blocks
  that it lacks exactly once (the sizes follow from the shapes: no size exchange).
- FSDP2 rows of a training tp slice, the training tp the engine's (same ranks, same split
  dim): the slice is the block. **One all-gather over the FSDP group per bucket** (the
  rows of the slice), and none over tp; weights split differently, or kept whole by one side
  only, take weight_sync's two gathers.

Each block is handed on inside a tensor of the whole weight's shape (`torch.empty`: on the
host the pages outside the block are never touched), so the engine's own loader, which cuts
its block out of a whole checkpoint tensor, reads it unchanged. This is the scheme of the CANN
team's seed for verl (per bucket: gather within the training tp domain only as far as the
rollout layout needs, all-to-all across it); expert all-to-all-v for MoE layers is not built.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from dagrl.engines.weight_sync import (
    BUCKET_BYTES,
    _buckets,
    _gather_bucket,
    _layout,
    _reshard,
    shard_rows,
)
from dagrl.rollout.shards import RolloutShard


@torch.no_grad()
def gather_rollout_shards(model: torch.nn.Module, shard: RolloutShard,
                          bucket_bytes: int = BUCKET_BYTES
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor of the whole weight's shape holding this rank's block) for every
    parameter of the FSDP2 (x tensor-parallel) `model`: a collective over its mesh, as
    `gather_full_weights` (module docstring)."""
    _reshard(model)
    me = dist.get_rank()
    kinds: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        layout = _layout(p)
        if layout is None:
            yield name, p.detach()
        elif layout == ("other",):
            yield name, p.full_tensor()
        elif layout[0] == "tp":
            kind = "slice" if _slice_is_block(name, p, layout, shard, me) else "tp"
            kinds.setdefault((kind, layout[1]), []).append((name, p))
        else:
            kinds.setdefault(("rows", layout[1]), []).append((name, p))
    for (kind, base), members in kinds.items():
        for bucket in _buckets(members, bucket_bytes):
            if kind == "rows":
                yield from _exchange_blocks(bucket, base, shard)
            elif kind == "slice":
                yield from _gather_slices(bucket, base)
            else:
                yield from _gather_bucket(bucket, base, True)


def _slice_is_block(name: str, p: torch.Tensor, layout: tuple, shard: RolloutShard,
                    me: int) -> bool:
    """Whether this rank's training tp slice of `p` is exactly its rollout block (on every
    rank alike: the same sizes and split dims everywhere)."""
    tp_dim = layout[1] + 1
    mesh = p.device_mesh
    return (mesh.size(tp_dim) == shard.size and layout[2] == shard.split_dim(name, p.shape)
            and mesh.get_local_rank(tp_dim) == me % shard.size)


def _gather_slices(bucket: list[tuple[str, torch.Tensor]],
                   base: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Training tp slices that are the rollout blocks: only the FSDP rows are gathered (one
    all-gather over the FSDP group: weight_sync's first step, with no second)."""
    tp_dim = base + 1
    tp_rank = bucket[0][1].device_mesh.get_local_rank(tp_dim)
    for (name, p), (_, piece) in zip(bucket, _gather_bucket(bucket, base, True,
                                                            slices_only=True), strict=True):
        whole = piece.new_empty(p.shape)
        dim = p.placements[tp_dim].dim
        width = p.shape[dim] // p.device_mesh.size(tp_dim)
        whole.narrow(dim, tp_rank * width, width).copy_(piece)
        yield name, whole


def _exchange_blocks(bucket: list[tuple[str, torch.Tensor]], base: int,
                     shard: RolloutShard) -> Iterator[tuple[str, torch.Tensor]]:
    """FSDP2 rows over mesh dim `base` -> each rank's rollout blocks: one all_to_all_single
    over that group (module docstring)."""
    group = bucket[0][1].device_mesh.get_group(base)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    peers = [dist.get_global_rank(group, q) for q in range(world)]
    local = [p.to_local() for _, p in bucket]
    starts = [[0, *torch.tensor(shard_rows(p.shape[0], world)).cumsum(0).tolist()]
              for _, p in bucket]
    for (name, _), t, s in zip(bucket, local, starts, strict=True):
        if t.shape[0] != s[me + 1] - s[me]:   # not torch.chunk rows: do not guess
            raise RuntimeError(f"weight sync: rank {me} holds {t.shape[0]} rows of {name!r}, "
                               f"expected {s[me + 1] - s[me]}")

    def part(i: int, holder: int, reader: int) -> tuple[slice, ...]:
        """Of parameter i: the rows `holder` holds that `reader`'s block needs, with the
        block's other dims (in whole-weight coordinates; empty rows when none)."""
        name, p = bucket[i]
        block = shard.block(name, tuple(p.shape), peers[reader])
        lo, hi = max(block[0].start, starts[i][holder]), min(block[0].stop, starts[i][holder + 1])
        return (slice(lo, max(lo, hi)),) + block[1:]

    def numel(region: tuple[slice, ...]) -> int:
        return math.prod(r.stop - r.start for r in region)

    # What this rank sends each peer, and receives from each, per parameter.
    outgoing = [[part(i, me, q) for i in range(len(bucket))] for q in range(world)]
    incoming = [[part(i, s, me) for i in range(len(bucket))] for s in range(world)]
    sends = []
    for regions in outgoing:
        for t, region, s in zip(local, regions, starts, strict=True):
            rows = slice(region[0].start - s[me], region[0].stop - s[me])
            sends.append(t[(rows,) + region[1:]].reshape(-1))
    send_sizes = [sum(map(numel, regions)) for regions in outgoing]
    recv_sizes = [sum(map(numel, regions)) for regions in incoming]
    send = torch.cat(sends) if sends else local[0].new_empty(0)
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes,
                           input_split_sizes=send_sizes, group=group)
    wholes = [t.new_empty(p.shape) for (_, p), t in zip(bucket, local, strict=True)]
    offset = 0
    for regions in incoming:
        for whole, region in zip(wholes, regions, strict=True):
            n = numel(region)
            whole[region] = recv[offset:offset + n].view([r.stop - r.start for r in region])
            offset += n
    for (name, _), whole in zip(bucket, wholes, strict=True):
        yield name, whole
