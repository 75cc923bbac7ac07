"""Bucketed weight gathering from FSDP2 shards equals full_tensor(), with uneven shards."""

from __future__ import annotations

import pytest

from dagrl.engines.weight_sync import shard_rows
from tests.dist_helpers import run_distributed


def test_shard_rows_follow_torch_chunk():
    import torch

    for rows in (0, 1, 5, 48, 64, 65):
        for world in (1, 2, 3, 4):
            expected = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
            expected += [0] * (world - len(expected))
            assert shard_rows(rows, world) == expected, (rows, world)


def _gather(rank, world, model_dir, bucket_bytes):
    import torch
    import torch.distributed as dist

    from dagrl.engines import weight_sync
    from dagrl.engines.models import load_model
    from dagrl.engines.sharding import shard_model

    model = shard_model(load_model(model_dir), world, "cpu")
    calls = []
    real = dist.all_gather_single

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    weight_sync.dist.all_gather_single = counted
    ours = dict(weight_sync.gather_full_weights(model, bucket_bytes=bucket_bytes))
    mismatched = [name for name, p in model.named_parameters()
                  if not torch.equal(ours[name], p.full_tensor())]
    return mismatched, len(calls), len(list(model.parameters())), list(ours)


@pytest.mark.slow   # every 2-worker run gathers weights to its rollout engine in buckets
# Many buckets only: one bucket is what every 2-worker parity run syncs (tests/test_runtime.py).
@pytest.mark.parametrize("bucket_bytes", [4096], ids=["many-buckets"])
def test_bucketed_gather_equals_full_tensor_with_uneven_shards(tiny_model_dir, bucket_bytes):
    # 3 ranks: 64 rows shard as 22/22/20, the 48-token vocabulary as 16/16/16.
    results = run_distributed(_gather, 3, str(tiny_model_dir), bucket_bytes)
    for mismatched, collectives, n_params, _names in results:
        assert mismatched == []
        assert collectives < n_params                 # fewer collectives than parameters
        if bucket_bytes == 2**30:
            assert collectives == 1
    assert results[0][3] == results[1][3] == results[2][3]


def _tp_sync(rank, world, model_dir, bucket_bytes):
    """dp=2 x tp=2: gather the full weights, counting every collective and received byte."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dagrl.engines import weight_sync
    from dagrl.engines.mesh import build_train_mesh, parallelize_model
    from dagrl.engines.models import load_model

    mesh = build_train_mesh(world, 2, 1, "cpu")
    model = parallelize_model(load_model(model_dir), mesh)
    dims = {tuple(dist.get_process_group_ranks(mesh.mesh[d].get_group())): d for d in ("dp", "tp")}
    calls: list[tuple[str, int]] = []      # (mesh dim, bytes received), in order
    real_gather, real_full = dist.all_gather_single, DTensor.full_tensor

    def all_gather_single(out, inp, group=None, **kwargs):
        dim = dims.get(tuple(dist.get_process_group_ranks(group)), "other")
        calls.append((dim, (out.numel() - inp.numel()) * out.element_size()))
        return real_gather(out, inp, group=group, **kwargs)

    def full_tensor(self, *args, **kwargs):        # a per-parameter gather
        calls.append(("full_tensor", 0))
        return real_full(self, *args, **kwargs)

    per_bucket, real_bucket = [], weight_sync._gather_bucket

    def gather_bucket(bucket, base, tensor_parallel):
        before = len(calls)
        yield from real_bucket(bucket, base, tensor_parallel)
        per_bucket.append((tensor_parallel, [d for d, _ in calls[before:]]))

    dist.all_gather_single, DTensor.full_tensor = all_gather_single, full_tensor
    weight_sync._gather_bucket = gather_bucket
    try:
        full = dict(weight_sync.gather_full_weights(model, bucket_bytes=bucket_bytes))
    finally:
        dist.all_gather_single, DTensor.full_tensor = real_gather, real_full
        weight_sync._gather_bucket = real_bucket
    reference = dict(load_model(model_dir).named_parameters())
    mismatched = [n for n, p in reference.items() if n not in full or not torch.equal(full[n], p)]
    whole = sum(p.numel() * p.element_size() for p in reference.values())
    own = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    # What gathering parameter by parameter would cost: one collective per sharded mesh dim.
    per_parameter = sum(1 + ("tp" in weight_sync._layout(p)) for p in model.parameters())
    return (mismatched, sorted(full) == sorted(reference), per_bucket, calls, whole, own,
            per_parameter)


@pytest.mark.slow   # the TP parity runs (test_model_parallel_runs.py) sync per mesh dim too
@pytest.mark.parametrize("bucket_bytes", [32768], ids=["many-buckets"])   # one: the tp runs
def test_tensor_parallel_sync_gathers_per_bucket_per_mesh_dim(tiny_model_dir, bucket_bytes):
    # 4 ranks: 2 data-parallel replicas x 2 tensor-parallel ranks.
    for (mismatched, complete, per_bucket, calls, whole, own,
         per_parameter) in run_distributed(_tp_sync, 4, str(tiny_model_dir), bucket_bytes):
        assert mismatched == [] and complete          # the rollout engine's whole weights
        # one all-gather over dp per bucket, and one over tp for the tensor-parallel buckets;
        # nothing else (no per-parameter gather)
        for tensor_parallel, dims in per_bucket:
            assert dims == (["dp", "tp"] if tensor_parallel else ["dp"]), dims
        assert {tp for tp, _ in per_bucket} == {True, False}
        collectives = sum(len(dims) for _, dims in per_bucket)
        assert collectives == len(calls)              # every collective was a bucket's
        if bucket_bytes == 2**30:
            assert collectives == 3                   # 1 replicated + 1 tp bucket
        else:
            assert len(per_bucket) > 2 and collectives < per_parameter
        # each rank receives what it lacks of the model, plus at most a bucket of padding
        received = sum(b for _, b in calls)
        assert whole - own <= received <= whole - own + bucket_bytes, (received, whole, own)
