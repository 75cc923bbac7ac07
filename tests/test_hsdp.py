"""HSDP (trainer.fsdp_shard_size): models sharded within groups of ranks and replicated across
them. The weight sync gathers from the rank's own group only and yields the full weights; a
4-worker run with 2 groups of 2 reproduces the 1-worker run, also when it stops after a
checkpoint and resumes from it."""

from __future__ import annotations

import pytest

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.schema import Config
from tests.dist_helpers import assert_resumed_run_matches_one_worker, run_distributed

SMALL = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
         "data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=2",
         "rollout.max_new_tokens=8"]
COMPARED = ["reward/mean", "response/length/mean", "actor/pg_loss", "actor/kl",
            "actor/entropy", "actor/grad_norm"]


def _gather(rank, world, model_dir, shard_size):
    import torch
    import torch.distributed as dist

    from dagrl.engines import weight_sync
    from dagrl.engines.models import load_model
    from dagrl.engines.sharding import shard_model

    model = shard_model(load_model(model_dir), world, "cpu", shard_size)
    groups = []
    real = dist.all_gather_into_tensor

    def counted(out, inp, group=None, **kwargs):
        groups.append(dist.get_world_size(group))
        return real(out, inp, group=group, **kwargs)

    weight_sync.dist.all_gather_into_tensor = counted
    ours = dict(weight_sync.gather_full_weights(model, bucket_bytes=4096))
    mismatched = [name for name, p in model.named_parameters()
                  if not torch.equal(ours[name], p.full_tensor())]
    from torch.distributed.tensor import Replicate, Shard

    hsdp = all(tuple(p.placements) == (Replicate(), Shard(0)) for p in model.parameters())
    return mismatched, sorted(set(groups)), hsdp


@pytest.mark.slow
def test_hsdp_weight_sync_gathers_inside_the_shard_group(tiny_model_dir):
    results = run_distributed(_gather, 4, str(tiny_model_dir), 2)
    for mismatched, group_sizes, hsdp in results:
        assert hsdp                      # replicated over the groups, sharded within one
        assert mismatched == []
        assert group_sizes == [2]        # every all-gather over the rank's group of 2, not 4


def test_shard_size_must_divide_the_workers():
    with pytest.raises(ConfigError, match=r"trainer.fsdp_shard_size \(3\) must divide"):
        load_config(Config, None, ["trainer.n_workers=4", "trainer.fsdp_shard_size=3",
                                   "data.train_batch_size=8", "actor.mini_batch_size=8"])


@pytest.mark.parametrize("parallel", ["actor.tensor_parallel_size=2",
                                      "actor.sequence_parallel_size=2"])
def test_shard_groups_are_refused_with_tensor_or_sequence_parallelism(parallel):
    # HSDP's (replicate, shard) mesh is built for FSDP2 alone, not for the dp x sp x tp mesh
    with pytest.raises(ConfigError, match=r"trainer.fsdp_shard_size \(2\) < trainer.n_workers "
                                          r"\(4\) \(HSDP\) with actor.tensor_parallel_size"):
        load_config(Config, None, ["trainer.n_workers=4", "trainer.fsdp_shard_size=2", parallel,
                                   "data.train_batch_size=8", "actor.mini_batch_size=8"])
    # a shard group of all the workers is plain FSDP2: accepted
    load_config(Config, None, ["trainer.n_workers=4", "trainer.fsdp_shard_size=4", parallel,
                               "data.train_batch_size=8", "actor.mini_batch_size=8"])


def test_shard_groups_are_refused_in_async_mode():
    # the async trainer ranks shard over one 1-D subgroup (engines/sharding.py)
    with pytest.raises(ConfigError, match=r"trainer.mode=async with trainer.fsdp_shard_size "
                                          r"\(2\) < trainer.n_workers \(4\)"):
        load_config(Config, None, ["trainer.n_workers=4", "trainer.fsdp_shard_size=2",
                                   "trainer.mode=async", "trainer.val_before_train=false",
                                   "data.train_batch_size=8", "actor.mini_batch_size=8"])


@pytest.mark.slow
def test_four_workers_in_two_shard_groups_match_one_worker_across_a_resume(tmp_path):
    # 2 steps with a checkpoint after each (DCP writes each rank's HSDP shards), then the
    # same directory to step 3: it resumes from step 2's checkpoint
    assert_resumed_run_matches_one_worker(tmp_path, 4, SMALL, ["trainer.fsdp_shard_size=2"],
                                          COMPARED)
