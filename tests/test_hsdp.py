"""HSDP (trainer.fsdp_shard_size): models sharded within groups of ranks and replicated across
them, with FSDP2 alone or on the tensor / sequence-parallel mesh (each tp slice sharded within
groups of the dp x sp ranks). The weight sync gathers from the rank's own group only and yields
the full weights; a 4-worker run with 2 groups of 2 reproduces the 1-worker run, also when it
stops after a checkpoint and resumes from it, and so does HSDP under tensor parallelism."""

from __future__ import annotations

import pytest

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.schema import Config
from tests.dist_helpers import (
    assert_resumed_run_matches_one_worker,
    run_distributed,
)

SMALL = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
         "data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=2",
         "rollout.max_new_tokens=8"]
COMPARED = ["reward/mean", "response/length/mean", "actor/pg_loss", "actor/kl",
            "actor/entropy", "actor/grad_norm"]


def _gather(rank, world, model_dir, shard_size, tp=1, sp=1):
    import torch
    import torch.distributed as dist

    from dagrl.engines import weight_sync
    from dagrl.engines.mesh import build_train_mesh, parallelize_model
    from dagrl.engines.models import load_model
    from dagrl.engines.sharding import shard_model

    if tp * sp == 1:
        model = shard_model(load_model(model_dir), world, "cpu", shard_size)
    else:
        mesh = build_train_mesh(world, tp, sp, "cpu", shard_size)
        model = parallelize_model(load_model(model_dir), mesh)
    groups = []
    real = dist.all_gather_single

    def counted(out, inp, group=None, **kwargs):
        groups.append(dist.get_world_size(group))
        return real(out, inp, group=group, **kwargs)

    weight_sync.dist.all_gather_single = counted
    ours = dict(weight_sync.gather_full_weights(model, bucket_bytes=4096))
    mismatched = [name for name, p in model.named_parameters()
                  if not torch.equal(ours[name], p.full_tensor())]
    from torch.distributed.tensor import Replicate, Shard

    # replicated over the groups, rows sharded within one (strided under a tp row split)
    hsdp = all(p.placements[0] == Replicate() and (p.placements[1] == Shard(0) or getattr(
        p.placements[1], "dim", None) == 0) for p in model.parameters())
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


# HSDP under tp and sp: the vLLM venv's matrix run 8 trains them together in CI (.ci/run).
@pytest.mark.slow
@pytest.mark.parametrize("tp,sp", [(2, 1), (1, 2)], ids=["tp2", "sp2"])
def test_hsdp_on_the_mesh_gathers_inside_the_shard_group(tiny_model_dir, tp, sp):
    # 4 ranks, 2 data-parallel replicas of tp (or sp) 2. tp: FSDP2 shards each tp slice over
    # 1 of the 2 dp ranks (the shard group), replicated over the other; sp: over the 2 sp
    # ranks of a replica (dp_shard 1 x sp 2, flattened), replicated over the 2 replicas.
    shard = 1 if tp > 1 else 2
    for mismatched, group_sizes, hsdp in run_distributed(_gather, 4, str(tiny_model_dir), shard,
                                                         tp, sp):
        assert hsdp and mismatched == []
        # tp: the rows need no gather (shard group of 1), the slices one over tp (2)
        assert group_sizes == [2], group_sizes


def _layout(overrides: list[str]):
    from dagrl.engines.layout import EngineLayout

    cfg = load_config(Config, None, ["data.train_batch_size=8", "actor.mini_batch_size=8",
                                     *overrides])
    return EngineLayout.of(cfg, cfg.trainer.n_workers, device_type="cpu")


def test_shard_groups_on_the_mesh_are_groups_of_the_dp_x_sp_ranks():
    tp = _layout(["trainer.n_workers=8", "trainer.fsdp_shard_size=2",
                  "actor.tensor_parallel_size=2"])
    assert (tp.mesh, tp.model_shard_size, tp.replicas) == ((4, 1, 2), 2, 2)
    sp = _layout(["trainer.n_workers=4", "trainer.fsdp_shard_size=2",
                  "actor.sequence_parallel_size=2"])
    assert (sp.mesh, sp.model_shard_size, sp.replicas) == ((2, 2, 1), 2, 2)
    # 4 workers under tp 2: FSDP2 shards each slice over 2 dp ranks; a shard size of 2 is all
    # of them (no replica), so it is refused rather than read as plain FSDP2
    with pytest.raises(ConfigError, match=r"trainer.fsdp_shard_size \(2\): under tensor "
                                          r"parallelism \(2\) FSDP2 shards each slice over "
                                          r"the 2 dp x sp ranks"):
        _layout(["trainer.n_workers=4", "trainer.fsdp_shard_size=2",
                 "actor.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"must be a multiple of "
                                          r"actor.sequence_parallel_size \(2\)"):
        _layout(["trainer.n_workers=4", "trainer.fsdp_shard_size=1",
                 "actor.sequence_parallel_size=2"])


def test_async_trainer_ranks_shard_in_groups_and_the_rollout_side_over_all_its_ranks():
    # 8 workers: trainer ranks 0-3 in 2 shard groups of 2 (the mesh every rank makes,
    # sharding.hsdp_mesh); the rollout side's reference, forward only, over its 4 ranks
    from dagrl.engines.layout import EngineLayout

    cfg = load_config(Config, None, ["trainer.n_workers=8", "trainer.fsdp_shard_size=2",
                                     "trainer.mode=async", "data.train_batch_size=8",
                                     "actor.mini_batch_size=8"])
    trainer = EngineLayout.of(cfg, 8, side_ranks=(0, 1, 2, 3), side="trainer",
                              device_type="cpu")
    rollout = EngineLayout.of(cfg, 8, side_ranks=(4, 5, 6, 7), side="rollout",
                              device_type="cpu")
    assert (trainer.hsdp, trainer.model_shard_size, trainer.replicas) == (True, 2, 2)
    assert trainer.grad_scale == 4                   # gradients averaged over all 4
    assert (rollout.hsdp, rollout.model_shard_size) == (False, 4)
    # 4 workers: 2 trainer ranks, one group of 2: not HSDP, refused rather than run as FSDP2
    small = load_config(Config, None, ["trainer.n_workers=4", "trainer.fsdp_shard_size=2",
                                       "trainer.mode=async", "data.train_batch_size=8",
                                       "actor.mini_batch_size=8"])
    with pytest.raises(ConfigError, match=r"the async trainer side's 2 ranks \(of 4\) make no "
                                          r"more than one shard group"):
        EngineLayout.of(small, 4, side_ranks=(0, 1), side="trainer", device_type="cpu")


# Async HSDP with GRPO's or PPO's reference on the rollout side (the rollout ranks once built it
# on the trainer side's mesh: a crash) is the composition matrix's run with async, HSDP and PPO
# (8 workers, equal to 1 worker): tests/test_composition.py, docs/composition.md.

def _subset_mesh(rank, world):
    import torch
    import torch.distributed as dist

    from dagrl.engines.sharding import hsdp_mesh

    mesh = hsdp_mesh((0, 1, 2, 3), 2, "cpu")      # every rank makes it, ranks 4, 5 too
    if rank > 3:
        return None
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("shard"))
    return mesh.get_coordinate(), t.item()


def test_hsdp_mesh_over_a_subset_of_the_ranks():
    got = run_distributed(_subset_mesh, 6)
    assert got[:4] == [((0, 0), 1.0), ((0, 1), 1.0), ((1, 0), 5.0), ((1, 1), 5.0)]
    assert got[4:] == [None, None]


@pytest.mark.slow   # the composition matrix trains tp x hsdp on 8 workers (no resume)
def test_hsdp_under_tensor_parallelism_matches_one_worker_across_a_resume(tmp_path):
    # 4 workers: 2 replicas of tp 2, each tp slice whole on its rank (shard groups of 1) and
    # replicated across the replicas (gradients all-reduced over the replicate dim); DCP
    # writes and reads the 3-D (replicate, shard, tp) shards
    assert_resumed_run_matches_one_worker(tmp_path, 4, SMALL, ["trainer.fsdp_shard_size=1",
                                                               "actor.tensor_parallel_size=2"],
                                          COMPARED)


@pytest.mark.slow
def test_four_workers_in_two_shard_groups_match_one_worker_across_a_resume(tmp_path):
    # 2 steps with a checkpoint after each (DCP writes each rank's HSDP shards), then the
    # same directory to step 3: it resumes from step 2's checkpoint
    assert_resumed_run_matches_one_worker(tmp_path, 4, SMALL, ["trainer.fsdp_shard_size=2"],
                                          COMPARED)
