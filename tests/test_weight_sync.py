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
    real = dist.all_gather_into_tensor

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    weight_sync.dist.all_gather_into_tensor = counted
    ours = dict(weight_sync.gather_full_weights(model, bucket_bytes=bucket_bytes))
    mismatched = [name for name, p in model.named_parameters()
                  if not torch.equal(ours[name], p.full_tensor())]
    return mismatched, len(calls), len(list(model.parameters())), list(ours)


@pytest.mark.parametrize("bucket_bytes", [4096, 2**30], ids=["many-buckets", "one-bucket"])
def test_bucketed_gather_equals_full_tensor_with_uneven_shards(tiny_model_dir, bucket_bytes):
    # 3 ranks: 64 rows shard as 22/22/20, the 48-token vocabulary as 16/16/16.
    results = run_distributed(_gather, 3, str(tiny_model_dir), bucket_bytes)
    for mismatched, collectives, n_params, _names in results:
        assert mismatched == []
        assert collectives < n_params                 # fewer collectives than parameters
        if bucket_bytes == 2**30:
            assert collectives == 1
    assert results[0][3] == results[1][3] == results[2][3]
