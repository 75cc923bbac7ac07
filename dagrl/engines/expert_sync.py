"""Weight sync for expert parallelism (MoE): each expert goes only to the ranks that need it.

Training places expert e on rank `owner[e]` (expert parallelism); the rollout layout needs a
different set on each rank (`wanted[r]`: the experts rank r's rollout shard runs). Gathering
every expert everywhere would send each rank all E experts; instead, per bucket of experts, one
`all_to_all_single` with uneven splits (all-to-all-v) carries expert e from its owner to exactly
the ranks that want it. All experts of a weight have the same shape, so every rank computes both
its send and its receive splits from the two placements alone: no exchange of sizes first.

Bytes received by rank r: the experts it wants and does not own, each once; nothing else.
This is the design the weight sync of a MoE model would use per expert weight; no MoE model in
dagrl uses it yet (tests/test_weight_sync.py runs it on a toy layer's experts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from dagrl.device import HOST


def exchange_experts(local: Mapping[int, torch.Tensor], owner: Sequence[int],
                     wanted: Sequence[Sequence[int]], shape: Sequence[int], dtype: torch.dtype,
                     *, group: dist.ProcessGroup | None = None, bucket_experts: int = 0,
                     device: torch.device | str = HOST) -> dict[int, torch.Tensor]:
    """`local`: this rank's experts by index (exactly those with owner[e] == this rank), each of
    `shape` and `dtype`; `owner[e]`: the rank training expert e; `wanted[r]`: the experts rank
    r needs. Returns this rank's wanted experts by index. Collective over `group`: one
    all-to-all-v per bucket of `bucket_experts` experts (0: one bucket)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if sorted(local) != [e for e, r in enumerate(owner) if r == me]:
        raise ValueError(f"exchange_experts: rank {me} holds experts {sorted(local)}, owns "
                         f"{[e for e, r in enumerate(owner) if r == me]}")
    wants = [set(w) for w in wanted]
    out = {e: local[e] for e in sorted(wants[me]) if owner[e] == me}   # kept: not sent
    numel = torch.Size(shape).numel()
    step = bucket_experts or len(owner)
    for start in range(0, len(owner), step):
        bucket = range(start, min(start + step, len(owner)))
        # To each peer the bucket's experts I own that it wants; from each peer the ones it owns
        # that I want (in expert order on both sides).
        sends = [[e for e in bucket if owner[e] == me and e in wants[d]] if d != me else []
                 for d in range(world)]
        recvs = [[e for e in bucket if owner[e] == s and e in wants[me]] if s != me else []
                 for s in range(world)]
        send_sizes = [len(x) * numel for x in sends]
        recv_sizes = [len(x) * numel for x in recvs]
        parts = [local[e].reshape(-1) for x in sends for e in x]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes,
                               input_split_sizes=send_sizes, group=group)
        pieces = iter(recv.split(numel)) if numel else iter(())
        for e in (e for x in recvs for e in x):
            out[e] = next(pieces).view(*shape)
    return out
