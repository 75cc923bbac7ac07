"""The move into the training layout under tensor / sequence parallelism, on 4 gloo processes in
2 replicas of 2 ranks: every sample reaches every rank of exactly one replica with all its
fields, groups stay whole and the replicas get equal group counts; the move back keeps each
sample on exactly one rank; `dagrl plan` shows the reshard with its volume."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_distributed
from tests.test_buffer import fingerprint, make_shard


def _replicate(rank, world, sizes, group_size):
    import torch.distributed as dist

    from dagrl.data.replicas import from_replicas, to_replicas

    shard = make_shard(rank, sizes[rank], group_size=2)
    replica_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(d, d + group_size)) for d in range(0, world, group_size)])
    there = to_replicas(shard, group_size, replica_group)
    back = from_replicas(there, group_size, rank % group_size)
    return fingerprint(shard), fingerprint(there), list(there["uid"]), fingerprint(back)


@pytest.mark.parametrize("sizes", [(6, 10, 0, 4),
                                   pytest.param((8, 8, 8, 8), marks=pytest.mark.slow)],
                         ids=["uneven", "even"])
def test_every_sample_reaches_each_rank_of_one_replica_once(sizes):
    world, group_size = 4, 2
    results = run_distributed(_replicate, world, sizes, group_size)
    sent = {}
    for original, *_ in results:
        sent.update(original)
    assert len(sent) == sum(sizes)
    replicas = [results[d * group_size:(d + 1) * group_size] for d in range(world // group_size)]
    seen = []
    for members in replicas:
        held = [m[1] for m in members]
        uids = [m[2] for m in members]
        # every rank of the replica holds the same samples, in the same order, all fields
        assert all(h == held[0] for h in held) and all(u == uids[0] for u in uids)
        assert all(held[0][i] == sent[i] for i in held[0])
        seen.extend(held[0])
        # whole groups (2 samples each), each once
        assert len(uids[0]) == len(set(uids[0])) * 2
    assert sorted(seen) == sorted(sent)                  # each sample in exactly one replica
    groups = [len(m[0][1]) // 2 for m in replicas]
    assert max(groups) - min(groups) <= 1               # balanced over the replicas
    # back to shards: each sample on exactly one rank, with its fields
    back = [sample for r in results for sample in r[3].items()]
    assert sorted(i for i, _ in back) == sorted(sent) and all(v == sent[i] for i, v in back)


def test_plan_shows_the_reshard_into_the_training_layout(capsys):
    from dagrl.cli import main

    assert main(["plan", "trainer.n_workers=2", "actor.tensor_parallel_size=2"]) == 0
    out = capsys.readouterr().out
    rank0 = out[out.index("rank 0:"):out.index("rank 1:")]
    lines = rank0.splitlines()[1:]
    # rollout and reward on each rank's own prompts, then one move into the replica, which
    # balances as it fills it (no separate balance task), then the model nodes on it
    assert lines[0].endswith("run rollout [rollout]") and lines[1].endswith("run reward [reward]")
    assert "reshard ranks 0,1 -> training layout: 1 replica(s) x 2 ranks" in lines[2]
    assert "(before ref_logprob)" in lines[2]
    # 32 prompts x 8 samples: rank 1's 128 samples come to rank 0, each with its declared
    # fields: prompt ids and mask (16 tokens), row index and position, responses (6 tokens),
    # 3 float fields of 6 (mask, rollout log-probs, token-level scores), seed, score
    per_sample = 2 * 16 * 8 + 2 * 8 + 6 * 8 + 3 * 6 * 4 + 8 + 4
    assert f"<= 128 samples x {per_sample} B" in lines[2]
    assert [ln.split(". ", 1)[1] for ln in lines[3:]] == [
        "run ref_logprob [ref_logprob] on 1 replicas", "run advantage [advantage] on 1 replicas",
        "run actor_update [actor_update] on 1 replicas"]
