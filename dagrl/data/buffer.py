"""The data buffer: moving samples between workers directly, with no coordinator.

Three operations, each collective over a process group (every rank calls it):

- `exchange(batch, dest)`: send each sample to the rank `dest[i]`. Sizes go first (one small
  all_to_all of byte counts), then one all_to_all of the packed samples grouped by
  destination (paired isend/irecv where the backend has no all_to_all). A rank keeps what it
  sends to itself without packing it. What a rank receives is ordered by source rank, then by
  the sender's order, so the global order of samples is preserved.
- `reshard(batch, src, dst)`: data spread over ranks `src` (in rank order) is re-spread over
  ranks `dst` in contiguous, near-equal runs of whole groups (used around nodes placed on a
  subset of ranks).
- `balance(batch, ranks)`: before a training node, whole groups are re-assigned so every rank
  gets the same number of groups and a similar token count (see `balanced_partition`).

A *group* is a run of consecutive samples with the same `uid` (a prompt's n responses): it is
never split across ranks, so per-group statistics (GRPO) stay local.
"""

from __future__ import annotations

import pickle
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from dagrl.data.batch import Batch

GROUP_KEY = "uid"
_ALIGN = 8   # bytes: the largest element size we ship (int64 / float64)


# --- packing: a Batch <-> one flat uint8 tensor --------------------------------------------------
def _padding(nbytes: int) -> int:
    return -nbytes % _ALIGN


def pack(batch: Batch, device: torch.device | str = "cpu") -> torch.Tensor:
    """[header length (8 bytes) | pickled header | raw tensor bytes, field after field].

    The header holds the schema (dtype and trailing shape of every tensor field) and the
    non-tensor fields, so even an empty chunk tells the receiver what the batch looks like.
    Every section is padded to 8 bytes, so the receiver can view each field in place, and
    chunks placed back to back in one receive buffer stay aligned.
    """
    tensors = batch.tensors
    schema = [(k, str(tensors[k].dtype).removeprefix("torch."), tuple(tensors[k].shape[1:]))
              for k in tensors.keys()]
    header = pickle.dumps({"n": len(batch), "schema": schema,
                           "non_tensors": {k: v for k, v in batch.non_tensors.items()}},
                          protocol=pickle.HIGHEST_PROTOCOL)
    header += bytes(_padding(len(header)))
    parts = [torch.tensor(list(len(header).to_bytes(8, "little")), dtype=torch.uint8),
             torch.frombuffer(bytearray(header), dtype=torch.uint8)]
    parts = [p.to(device) for p in parts]
    for key, _, _ in schema:
        raw = tensors[key].contiguous().reshape(-1).view(torch.uint8).to(device)
        parts.append(raw)
        if _padding(len(raw)):
            parts.append(torch.zeros(_padding(len(raw)), dtype=torch.uint8, device=device))
    return torch.cat(parts)


def unpack(buf: torch.Tensor, device: torch.device | str = "cpu") -> Batch:
    head_len = int.from_bytes(bytes(buf[:8].cpu().tolist()), "little")
    header = pickle.loads(buf[8:8 + head_len].cpu().numpy().tobytes())
    n, offset, tensors = header["n"], 8 + head_len, {}
    for key, dtype_name, trailing in header["schema"]:
        dtype = getattr(torch, dtype_name)
        count = n * int(np.prod(trailing, dtype=np.int64))
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        raw = buf[offset:offset + nbytes].to(device)
        tensors[key] = raw.view(dtype).reshape(n, *trailing).clone()
        offset += nbytes + _padding(nbytes)
    return Batch(tensors, header["non_tensors"], batch_size=n)


def _concat_parts(parts: Sequence[Batch]) -> Batch:
    """Concatenate received chunks in source order. Empty chunks carry only a schema, which may
    be older than the data's (a rank that skipped a node never saw its new fields), so they are
    left out; when everything is empty, the widest schema stands for the batch."""
    non_empty = [p for p in parts if len(p)]
    if non_empty:
        return Batch.concat(non_empty)
    return max(parts, key=lambda p: len(p.keys()))


# --- the collective move -------------------------------------------------------------------------
def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _all_to_all_bytes(send: list[torch.Tensor], group: dist.ProcessGroup | None,
                      device: torch.device, use_p2p: bool) -> list[torch.Tensor]:
    """send[d] goes to group rank d; returns recv[s] from group rank s. Sizes first."""
    world, me = _group_size_rank(group)
    send_sizes = torch.tensor([len(s) for s in send], dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    recv_list = recv_sizes.tolist()
    if use_p2p:
        recv = [torch.empty(size, dtype=torch.uint8, device=device) for size in recv_list]
        ops = []
        for peer in range(world):
            if peer == me:
                continue
            global_peer = dist.get_global_rank(group, peer) if group is not None else peer
            if len(send[peer]):
                ops.append(dist.P2POp(dist.isend, send[peer], global_peer, group))
            if recv_list[peer]:
                ops.append(dist.P2POp(dist.irecv, recv[peer], global_peer, group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return recv
    payload = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8, device=device)
    out = torch.empty(sum(recv_list), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, payload, output_split_sizes=recv_list,
                           input_split_sizes=[len(s) for s in send], group=group)
    return list(out.split(recv_list))


def exchange(batch: Batch, dest: torch.Tensor | Sequence[int], group: dist.ProcessGroup | None = None,
             *, device: torch.device | str = "cpu", use_p2p: bool = False) -> Batch:
    """Send sample i to group rank dest[i]; returns what this rank receives (see module doc)."""
    world, me = _group_size_rank(group)
    dest = torch.as_tensor(dest, dtype=torch.long).cpu()
    if len(dest) != len(batch):
        raise ValueError(f"exchange: {len(dest)} destinations for {len(batch)} samples")
    if len(dest) and (int(dest.min()) < 0 or int(dest.max()) >= world):
        raise ValueError(f"exchange: destinations must be group ranks in [0, {world})")
    device = torch.device(device)
    selections = [torch.nonzero(dest == d).flatten() for d in range(world)]
    keep = batch.select(selections[me])
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    send = [empty if d == me else pack(batch.select(idx), device)
            for d, idx in enumerate(selections)]
    recv = _all_to_all_bytes(send, group, device, use_p2p)
    parts = [keep if s == me else unpack(buf, batch_device(batch, device))
             for s, buf in enumerate(recv)]
    return _concat_parts(parts)


def batch_device(batch: Batch, default: torch.device) -> torch.device:
    for key in batch.tensors.keys():
        return batch.tensors[key].device
    return default


# --- groups, layouts, balancing ------------------------------------------------------------------
def group_runs(batch: Batch) -> np.ndarray:
    """Start index of each group (run of equal `uid`); every sample is its own group without
    uids. Errors if a uid appears in two separate runs (the group would be split)."""
    n = len(batch)
    if GROUP_KEY not in batch or n == 0:
        return np.arange(n)
    uids = np.asarray(batch[GROUP_KEY], dtype=str)
    starts = np.flatnonzero(np.concatenate([[True], uids[1:] != uids[:-1]]))
    if len(np.unique(uids[starts])) != len(starts):
        raise ValueError("data buffer: the samples of a group (same uid) are not contiguous")
    return starts


def _sample_dest(batch: Batch, starts: np.ndarray, group_dest: Sequence[int]) -> torch.Tensor:
    sizes = np.diff(np.append(starts, len(batch)))
    return torch.as_tensor(np.repeat(np.asarray(group_dest, dtype=np.int64), sizes))


def reshard(batch: Batch, src: Sequence[int], dst: Sequence[int],
            group: dist.ProcessGroup | None = None, **kw) -> Batch:
    """Re-spread data held by group ranks `src` over group ranks `dst` (module doc).

    Ranks outside `src` must hold an empty batch; ranks outside `dst` end with an empty one.
    The global order (src ranks in order) is kept: dst ranks get contiguous runs of groups,
    near-equal in number (earlier ranks one more when they do not divide evenly).
    """
    world, me = _group_size_rank(group)
    starts = group_runs(batch)
    if me not in src and len(batch):
        raise ValueError(f"reshard: rank {me} is not in the source layout {list(src)} but holds "
                         f"{len(batch)} samples")
    counts = torch.zeros(world, dtype=torch.int64, device=kw.get("device", "cpu"))
    counts[me] = len(starts)
    if world > 1:
        dist.all_reduce(counts, group=group)   # groups per rank ("sizes first")
    counts = counts.cpu()
    total = int(counts.sum())
    offset = int(counts[:me].sum())
    # Group g of the global order goes to dst[part(g)], parts near-equal and contiguous.
    bounds = np.cumsum([0] + [total // len(dst) + (i < total % len(dst)) for i in range(len(dst))])
    part = np.searchsorted(bounds, np.arange(offset, offset + len(starts)), side="right") - 1
    group_dest = [list(dst)[p] for p in part]
    return exchange(batch, _sample_dest(batch, starts, group_dest), group, **kw)


def balanced_partition(weights: Sequence[int], k: int) -> list[int]:
    """Assign items (groups) to k parts with equal counts (±1) and similar total weight.

    Items are taken in decreasing weight, k at a time; in each round the heaviest item goes to
    the currently lightest part, the next to the next lightest, and so on (a partial last round
    fills the lightest parts). Bound: max part weight − min part weight ≤ the largest item weight
    (a round can widen the spread only to the spread of its own items, and the spread carried
    in never grows: see docs/architecture.md). Deterministic: ties break by index.
    """
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    loads = [0] * k
    part = [0] * len(weights)
    for start in range(0, len(order), k):
        round_items = order[start:start + k]
        lightest = sorted(range(k), key=lambda p: (loads[p], p))
        for item, p in zip(round_items, lightest):
            part[item] = p
            loads[p] += weights[item]
    return part


def sample_tokens(batch: Batch) -> torch.Tensor:
    """Tokens per sample (prompt + response), the cost measure that balancing equalises."""
    total = torch.zeros(len(batch), dtype=torch.long)
    for key in ("prompt_mask", "response_mask"):
        if key in batch:
            total += batch[key].sum(-1).long().cpu()
    return total


def balance(batch: Batch, ranks: Sequence[int], group: dist.ProcessGroup | None = None,
            **kw) -> Batch:
    """Re-assign whole groups over group ranks `ranks` by `balanced_partition` of their tokens."""
    world, _ = _group_size_rank(group)
    starts = group_runs(batch)
    tokens = sample_tokens(batch).numpy()
    mine = [int(x) for x in np.add.reduceat(tokens, starts)] if len(starts) else []
    gathered: list[list[int]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine, group=group)
    everything = [w for per_rank in gathered for w in per_rank]
    part = balanced_partition(everything, len(ranks))
    offset = sum(len(g) for g in gathered[:dist.get_rank(group)])
    group_dest = [list(ranks)[p] for p in part[offset:offset + len(mine)]]
    return exchange(batch, _sample_dest(batch, starts, group_dest), group, **kw)
