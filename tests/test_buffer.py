"""The data buffer across 2 and 4 gloo processes: every sample exactly once, every field kept."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from dagrl.data.batch import Batch
from dagrl.data.buffer import balanced_partition, pack, unpack
from tests.dist_helpers import run_distributed


def make_shard(rank: int, n: int, group_size: int = 1, width: int = 5) -> Batch:
    """n samples with globally unique ids; groups of `group_size` consecutive samples share a
    uid."""
    ids = torch.arange(n) + 1000 * rank
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return Batch(
        tensors={"sample_id": ids, "response_mask": mask,
                 "logprobs": torch.randn(n, width, generator=g, dtype=torch.float64),
                 "responses": torch.randint(0, 50, (n, width), generator=g)},
        non_tensors={"uid": [f"r{rank}-g{int(i) // group_size}" for i in range(n)],
                     "extra_info": [{"rank": rank, "i": int(i), "tags": ["a", int(i)]}
                                    for i in range(n)]},
        batch_size=n)


def fingerprint(batch: Batch) -> dict[int, tuple]:
    """sample_id -> every field of the sample, for exact comparison."""
    out = {}
    for i in range(len(batch)):
        out[int(batch["sample_id"][i])] = (
            batch["response_mask"][i].tolist(), batch["logprobs"][i].tolist(),
            batch["responses"][i].tolist(), batch["uid"][i], repr(batch["extra_info"][i]))
    return out


def test_pack_roundtrip_including_empty():
    b = make_shard(3, 7, group_size=2)
    back = unpack(pack(b))
    assert fingerprint(back) == fingerprint(b)
    assert back["logprobs"].dtype == torch.float64
    empty = unpack(pack(b.select([])))
    assert len(empty) == 0 and set(empty.keys()) == set(b.keys())
    assert empty["logprobs"].shape == (0, 5)


def _exchange(rank, world, sizes, seed, use_p2p):
    from dagrl.data.buffer import exchange

    shard = make_shard(rank, sizes[rank])
    dest = torch.from_numpy(np.random.default_rng([seed, rank]).integers(0, world, sizes[rank]))
    out = exchange(shard, dest, use_p2p=use_p2p)
    sent = {int(i): int(d) for i, d in zip(shard["sample_id"], dest, strict=True)}
    return fingerprint(shard), sent, fingerprint(out), out["sample_id"].tolist()


def _reshard(rank, world, sizes):
    from dagrl.data.buffer import reshard

    shard = make_shard(rank, sizes[rank], group_size=2)
    there = reshard(shard, src=tuple(range(world)), dst=(0, 1))      # onto a subset of ranks
    if rank in (0, 1):      # the "node" on ranks 0 and 1 adds a field computed from the data
        there["score"] = there["logprobs"].sum(-1)
    else:
        assert len(there) == 0
    held = len(there)
    back = reshard(there, src=(0, 1), dst=tuple(range(world)))
    return (fingerprint(shard), shard["sample_id"].tolist(), held, back["sample_id"].tolist(),
            back["score"].tolist(), fingerprint(back), back["uid"].tolist())


def _balance(rank, world, n_groups, group_size):
    from dagrl.data.buffer import balance, sample_tokens

    shard = make_shard(rank, n_groups[rank] * group_size, group_size=group_size, width=40)
    if rank == 0:   # very uneven lengths across ranks: rank 0 has the long ones
        shard["response_mask"] = torch.ones_like(shard["response_mask"])
    out = balance(shard, ranks=tuple(range(world)))
    largest = max(sample_tokens(shard).view(-1, group_size).sum(-1).tolist() or [0])
    return (fingerprint(shard), fingerprint(out), int(sample_tokens(out).sum()),
            len(set(out["uid"].tolist())), int(largest))


EXCHANGE_SIZES = {2: [[5, 0], [0, 7]], 4: [[0, 3, 8, 1], [6, 0, 2, 7]]}


def _scenarios(rank, world):
    """Every scenario in one process launch (starting processes is the slow part)."""
    return {
        "exchange": [_exchange(rank, world, sizes, trial, use_p2p)
                     for trial, sizes in enumerate(EXCHANGE_SIZES[world])
                     for use_p2p in (False, True)],
        "reshard": _reshard(rank, world, [6, 0, 4, 8][:world]),
        "balance": _balance(rank, world, [8, 2, 6, 0][:world], 4),
    }


@functools.cache
def results_for(world: int):
    per_rank = run_distributed(_scenarios, world)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_exchange_delivers_every_sample_once(world):
    """Random destinations, ranks with no samples, all_to_all and paired send/recv."""
    per_rank = results_for(world)["exchange"]
    for case in range(len(per_rank[0])):
        results = [r[case] for r in per_rank]
        before, dest = {}, {}
        for fp, sent, _, _ in results:
            before.update(fp)
            dest.update(sent)
        seen = []
        for rank, (_, _, got, order) in enumerate(results):
            seen.extend(got)
            for sid in got:
                assert dest[sid] == rank              # delivered where it was sent
                assert got[sid] == before[sid]        # with every field intact
            # ordered by source rank, then by the sender's order
            assert order == sorted(order, key=lambda s: (s // 1000, s % 1000))
        assert sorted(seen) == sorted(before)         # exactly once


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_node_on_a_subset_of_ranks_round_trip(world):
    results = results_for(world)["reshard"]
    sizes = [6, 0, 4, 8][:world]
    before, global_order, after_order = {}, [], []
    for fp, ids, *_ in results:
        before.update(fp)
        global_order.extend(ids)
    for _, _, _, back_ids, scores, back_fp, uids in results:
        after_order.extend(back_ids)
        for sid, score in zip(back_ids, scores, strict=True):
            assert back_fp[sid] == before[sid]                 # every field survives the trip
            assert score == pytest.approx(sum(before[sid][1]))  # computed on ranks 0/1
        assert all(uids.count(u) == 2 for u in uids)           # groups are never split
    assert after_order == global_order            # every sample back, global order kept
    held = [r[2] for r in results]
    assert sum(held[:2]) == sum(sizes) and sum(held[2:]) == 0
    assert abs(held[0] - held[1]) <= 2            # near-equal in whole groups


def test_balanced_partition_bound_and_counts():
    rng = np.random.default_rng(0)
    for k in (2, 3, 4, 8):
        for _ in range(50):
            weights = rng.integers(1, 500, rng.integers(k, 60)).tolist()
            part = balanced_partition(weights, k)
            loads = [sum(w for w, p in zip(weights, part, strict=True) if p == q) for q in range(k)]
            counts = [part.count(q) for q in range(k)]
            assert max(counts) - min(counts) <= 1
            assert max(loads) - min(loads) <= max(weights)     # the stated bound


@pytest.mark.parametrize("world", [2, 4])
def test_balance_equalises_tokens_and_keeps_groups(world):
    results = results_for(world)["balance"]
    before, after = {}, {}
    for fp, out_fp, *_ in results:
        before.update(fp)
        after.update(out_fp)
    assert after == before                           # every sample, every field, exactly once
    assert sum(len(r[1]) for r in results) == len(before)
    tokens, groups = [r[2] for r in results], [r[3] for r in results]
    largest_group = max(r[4] for r in results)
    assert max(groups) - min(groups) <= 1
    assert max(tokens) - min(tokens) <= largest_group
