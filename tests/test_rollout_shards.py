"""Weights into a tensor-parallel rollout engine's shards (engines/rollout_shards.py): each
rank receives only its blocks, with the collectives of the scheme, and they equal the trained
weights bit for bit. 4 ranks, a rollout engine over 2 (rollout.vllm.tensor_parallel_size=2):
from FSDP2 over all 4, and from the actor's own tp 2 (dp 2 x tp 2)."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_distributed

ROLLOUT_TP = 2


def _sync(rank, world, model_dir, actor_tp, bucket_bytes):
    import torch
    import torch.distributed as dist

    from dagrl.engines import rollout_shards
    from dagrl.engines.mesh import build_train_mesh, parallelize_model
    from dagrl.engines.models import load_model
    from dagrl.engines.rollout_shards import gather_rollout_shards
    from dagrl.engines.sharding import shard_model
    from dagrl.rollout.shards import RolloutShard

    if actor_tp == 1:
        model = shard_model(load_model(model_dir), world, "cpu")
        dims = {tuple(range(world)): "fsdp"}
    else:
        mesh = build_train_mesh(world, actor_tp, 1, "cpu")
        model = parallelize_model(load_model(model_dir), mesh)
        dims = {tuple(dist.get_process_group_ranks(mesh.mesh[d].get_group())): d
                for d in ("dp", "tp")}
    shard = RolloutShard(ROLLOUT_TP, kv_heads=model.config.num_key_value_heads)
    calls: list[tuple[str, str, int]] = []      # (collective, group, bytes received)
    real_gather, real_a2a = dist.all_gather_single, dist.all_to_all_single

    def group_name(group):
        ranks = tuple(dist.get_process_group_ranks(group)) if group else tuple(range(world))
        return dims.get(ranks, str(ranks))

    def all_gather_single(out, inp, group=None, **kwargs):
        calls.append(("all_gather", group_name(group), (out.numel() - inp.numel())
                      * out.element_size()))
        return real_gather(out, inp, group=group, **kwargs)

    def all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None,
                          group=None, **kwargs):
        mine = output_split_sizes[dist.get_rank(group)]
        calls.append(("all_to_all", group_name(group), (out.numel() - mine) * out.element_size()))
        return real_a2a(out, inp, output_split_sizes, input_split_sizes, group=group, **kwargs)

    per_bucket, real_kinds, depth = [], {}, [0]
    for kind in ("_exchange_blocks", "_gather_slices", "_gather_bucket"):
        real_kinds[kind] = getattr(rollout_shards, kind)

        def counted(*args, _kind=kind, **kwargs):   # a bucket's collectives, by its kind
            before = len(calls)
            depth[0] += 1
            yield from real_kinds[_kind](*args, **kwargs)
            depth[0] -= 1
            if not depth[0]:
                per_bucket.append((_kind, [(c, g) for c, g, _ in calls[before:]]))
        setattr(rollout_shards, kind, counted)
    dist.all_gather_single, dist.all_to_all_single = all_gather_single, all_to_all_single
    try:
        ours = dict(gather_rollout_shards(model, shard, bucket_bytes=bucket_bytes))
    finally:
        dist.all_gather_single, dist.all_to_all_single = real_gather, real_a2a
        for kind, fn in real_kinds.items():
            setattr(rollout_shards, kind, fn)
    reference = dict(load_model(model_dir).named_parameters())
    blocks = {n: shard.block(n, tuple(p.shape), rank) for n, p in reference.items()}
    mismatched = [n for n, p in reference.items()
                  if n not in ours or not torch.equal(ours[n][blocks[n]], p[blocks[n]])]
    split = sorted(n for n, p in reference.items()
                   if shard.split_dim(n, tuple(p.shape)) is not None)
    block_bytes = sum(p[blocks[n]].numel() * p.element_size() for n, p in reference.items())
    whole = sum(p.numel() * p.element_size() for p in reference.values())
    own = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return (mismatched, sorted(ours) == sorted(reference), split, per_bucket, calls,
            block_bytes, whole, own)


@pytest.mark.parametrize("bucket_bytes", [2**30, pytest.param(32768, marks=pytest.mark.slow)],
                         ids=["one-bucket", "many-buckets"])
def test_fsdp2_to_rollout_tp_is_one_all_to_all_per_bucket(tiny_model_dir, bucket_bytes):
    for (mismatched, complete, split, per_bucket, calls, block_bytes, whole,
         own) in run_distributed(_sync, 4, str(tiny_model_dir), 1, bucket_bytes):
        assert mismatched == [] and complete
        assert any(n.endswith("q_proj.weight") for n in split)
        assert any(n.endswith("down_proj.weight") for n in split)
        # one all-to-all over the FSDP group per bucket, nothing else
        assert {kind for kind, _ in per_bucket} == {"_exchange_blocks"}
        assert all(ops == [("all_to_all", "fsdp")] for _, ops in per_bucket), per_bucket
        assert len(calls) == len(per_bucket) == (1 if bucket_bytes == 2**30 else len(calls))
        # each byte of its blocks it lacks, once: less than the whole model's gather
        received = sum(b for *_, b in calls)
        assert block_bytes - own <= received <= block_bytes
        assert received < whole - own


@pytest.mark.parametrize("bucket_bytes", [2**30], ids=["one-bucket"])
def test_actor_tp_to_rollout_tp_gathers_over_dp_only_where_the_splits_agree(tiny_model_dir,
                                                                          bucket_bytes):
    for (mismatched, complete, _split, per_bucket, calls, _block_bytes, whole,
         own) in run_distributed(_sync, 4, str(tiny_model_dir), 2, bucket_bytes):
        assert mismatched == [] and complete
        ops = dict(per_bucket)
        # tp slices that are the rollout blocks: the FSDP rows only (dp), no tp gather
        assert ops["_gather_slices"] == [("all_gather", "dp")]
        # what tp keeps whole (norms, the one KV head): the rows, from the dp peers
        assert ops["_exchange_blocks"] == [("all_to_all", "dp")]
        # the vocabulary (vLLM pads it its own way): gathered whole, dp then tp
        assert ops["_gather_bucket"] == [("all_gather", "dp"), ("all_gather", "tp")]
        assert len(calls) == 4
        received = sum(b for *_, b in calls)
        assert received < whole - own
