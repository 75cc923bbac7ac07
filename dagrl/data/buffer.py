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
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from dagrl.data.batch import Batch, response_attention
from dagrl.device import HOST

GROUP_KEY = "uid"
_ALIGN = 8   # bytes: the largest element size we ship (int64 / float64)


# --- packing: a Batch <-> one flat uint8 tensor --------------------------------------------------
# Layout of a chunk: [header length (8 bytes) | pickled header | each tensor field's raw bytes].
# The header holds the schema (dtype and trailing shape of every tensor field) and the
# non-tensor fields, so even an empty chunk tells the receiver what the batch looks like. Every
# section is padded to 8 bytes, so the receiver can view each field in place, and chunks placed
# back to back in one buffer stay aligned. Rows are gathered straight into the send buffer
# (one copy) and viewed, not copied, out of the receive buffer.
def _padding(nbytes: int) -> int:
    return -nbytes % _ALIGN


def _schema(batch: Batch) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    t = batch.tensors
    return [(k, t[k].dtype, tuple(t[k].shape[1:])) for k in t.keys()]


def _field_nbytes(n: int, dtype: torch.dtype, trailing: tuple[int, ...]) -> int:
    nbytes = n * int(np.prod(trailing, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    return nbytes + _padding(nbytes)


def _chunk_header(batch: Batch, rows: np.ndarray, schema) -> bytes:
    header = pickle.dumps({"n": len(rows),
                           "schema": [(k, str(d).removeprefix("torch."), tr)
                                      for k, d, tr in schema],
                           "non_tensors": {k: v[rows] for k, v in batch.non_tensors.items()}},
                          protocol=pickle.HIGHEST_PROTOCOL)
    return header + bytes(_padding(len(header)))


def _chunk_size(header: bytes, n: int, schema) -> int:
    return 8 + len(header) + sum(_field_nbytes(n, d, tr) for _, d, tr in schema)


def _write_chunk(out: torch.Tensor, batch: Batch, rows: torch.Tensor, header: bytes,
                 schema) -> None:
    """Fill `out` (a uint8 view of exactly the chunk's size) with the rows `rows` of `batch`."""
    out[:8].copy_(torch.tensor(list(len(header).to_bytes(8, "little")), dtype=torch.uint8))
    out[8:8 + len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    offset, n = 8 + len(header), len(rows)
    for key, dtype, trailing in schema:
        size = _field_nbytes(n, dtype, trailing)
        raw = size - _padding(n * int(np.prod(trailing, dtype=np.int64))
                              * torch.empty(0, dtype=dtype).element_size())
        target = out[offset:offset + raw].view(dtype).view(n, *trailing)
        src = batch.tensors[key]
        torch.index_select(src, 0, rows.to(src.device), out=target)
        offset += size


def pack(batch: Batch, device: torch.device | str = HOST) -> torch.Tensor:
    """The whole batch as one chunk (see the layout above)."""
    schema = _schema(batch)
    rows = np.arange(len(batch))
    header = _chunk_header(batch, rows, schema)
    out = torch.empty(_chunk_size(header, len(rows), schema), dtype=torch.uint8, device=device)
    _write_chunk(out, batch, torch.from_numpy(rows), header, schema)
    return out


def unpack(buf: torch.Tensor, device: torch.device | str = HOST, *, copy: bool = True) -> Batch:
    """A chunk back into a Batch; with copy=False its tensors are views into `buf`."""
    head_len = int.from_bytes(bytes(buf[:8].cpu().tolist()), "little")
    header = pickle.loads(buf[8:8 + head_len].cpu().numpy().tobytes())
    n, offset, tensors = header["n"], 8 + head_len, {}
    for key, dtype_name, trailing in header["schema"]:
        dtype = getattr(torch, dtype_name)
        size = _field_nbytes(n, dtype, tuple(trailing))
        itemsize = torch.empty(0, dtype=dtype).element_size()
        raw = n * int(np.prod(trailing, dtype=np.int64)) * itemsize
        view = buf[offset:offset + raw].to(device).view(dtype).view(n, *trailing)
        tensors[key] = view.clone() if copy else view
        offset += size
    return Batch(tensors, header["non_tensors"], batch_size=n)


def _concat_parts(parts: Sequence[Batch], own: Batch | None = None) -> Batch:
    """Concatenate received chunks in source order into new storage (the chunks are views of a
    reused receive buffer). Empty chunks carry only a schema, which may be older than the
    data's (a rank that skipped a node never saw its new fields), so they are left out; when
    everything is empty, the widest schema stands for the batch. `own` (this rank's rows,
    already a copy) is returned as is when it is all there is."""
    non_empty = [p for p in parts if len(p)]
    if len(non_empty) == 1 and non_empty[0] is own:
        return own
    if non_empty:
        return Batch.concat(non_empty)
    return max(parts, key=lambda p: len(p.keys())).select([])


# Freshly mapped memory costs a page fault per 4 KiB page (measured here: ~0.7 ms per MiB, as
# much as the copy itself), so the send and receive buffers are kept and reused between
# exchanges: they grow to the largest exchange this process has made.
_SCRATCH: dict[tuple[str, str], torch.Tensor] = {}


def _scratch(name: str, nbytes: int, device: torch.device) -> torch.Tensor:
    key = (name, str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < nbytes:
        _SCRATCH.pop(key, None)   # drop the smaller one before allocating the larger
        buf = _SCRATCH[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]


# --- the collective move -------------------------------------------------------------------------
def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _all_to_all_bytes(send: torch.Tensor, send_sizes: list[int], group: dist.ProcessGroup | None,
                      device: torch.device, use_p2p: bool) -> list[torch.Tensor]:
    """send (one flat buffer, send_sizes[d] bytes for group rank d, in rank order) -> the chunks
    received from each group rank. Sizes first, then the bytes."""
    world, me = _group_size_rank(group)
    sizes = torch.tensor(send_sizes, dtype=torch.int64, device=device)
    recv_sizes = torch.empty_like(sizes)
    dist.all_to_all_single(recv_sizes, sizes, group=group)
    recv_list = recv_sizes.tolist()
    out = _scratch("recv", sum(recv_list), device)
    if not use_p2p:
        dist.all_to_all_single(out, send, output_split_sizes=recv_list,
                               input_split_sizes=send_sizes, group=group)
        return list(out.split(recv_list))
    sent, received = send.split(send_sizes), out.split(recv_list)
    ops = []
    for peer in range(world):
        if peer == me:
            continue
        global_peer = dist.get_global_rank(group, peer) if group is not None else peer
        if send_sizes[peer]:
            ops.append(dist.P2POp(dist.isend, sent[peer], global_peer, group))
        if recv_list[peer]:
            ops.append(dist.P2POp(dist.irecv, received[peer], global_peer, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return list(received)


def exchange(batch: Batch, dest: torch.Tensor | Sequence[int],
             group: dist.ProcessGroup | None = None, *, device: torch.device | str = HOST,
             use_p2p: bool = False) -> Batch:
    """Send sample i to group rank dest[i]; returns what this rank receives (see module doc)."""
    world, me = _group_size_rank(group)
    dest = torch.as_tensor(dest, dtype=torch.long).cpu()
    if len(dest) != len(batch):
        raise ValueError(f"exchange: {len(dest)} destinations for {len(batch)} samples")
    if len(dest) and (int(dest.min()) < 0 or int(dest.max()) >= world):
        raise ValueError(f"exchange: destinations must be group ranks in [0, {world})")
    device = torch.device(device)
    rows = [torch.nonzero(dest == d).flatten() for d in range(world)]
    keep = batch.select(rows[me])
    # One send buffer, chunks grouped by destination; nothing for ourselves.
    schema = _schema(batch)
    headers = [b"" if d == me else _chunk_header(batch, rows[d].numpy(), schema)
               for d in range(world)]
    sizes = [0 if d == me else _chunk_size(headers[d], len(rows[d]), schema) for d in range(world)]
    send = _scratch("send", sum(sizes), device)
    for d, chunk in enumerate(send.split(sizes)):
        if d != me:
            _write_chunk(chunk, batch, rows[d], headers[d], schema)
    recv = _all_to_all_bytes(send, sizes, group, device, use_p2p)
    out_device = batch_device(batch, device)
    # Views into the receive buffer: the concatenation into new storage is the only copy.
    parts = [keep if s == me else unpack(buf, out_device, copy=False) for s, buf in enumerate(recv)]
    return _concat_parts(parts, own=keep)


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
    counts = torch.zeros(world, dtype=torch.int64, device=kw.get("device", HOST))
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
        for item, p in zip(round_items, lightest, strict=False):   # the last round may be short
            part[item] = p
            loads[p] += weights[item]
    return part


def sample_tokens(batch: Batch) -> torch.Tensor:
    """Tokens per sample (prompt + response), the cost measure that balancing equalises."""
    total = torch.zeros(len(batch), dtype=torch.long)
    if "prompt_mask" in batch:
        total += batch["prompt_mask"].sum(-1).long().cpu()
    if "response_mask" in batch:   # with a multi-turn response's tool tokens
        total += response_attention(batch).sum(-1).long().cpu()
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
