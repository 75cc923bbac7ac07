"""DAPO's dynamic sampling (`filter`): keep the groups whose rewards vary, generating again on
fresh prompts (`ctx.more()`) until the batch is full. Every rank takes the same decisions from
globally summed counts (over the node's ranks), so they loop the same number of times; the
balance task before the update evens out what each rank kept. In trainer.mode=async the filter
runs on the rollout side (it reads no trained weights) and its fresh prompts are generated with
the weights the rollout ranks hold then, within the staleness bound like the rest.
"""

from __future__ import annotations

import torch

from dagrl.algorithms.shaping import groups_with_variance
from dagrl.data.batch import Batch
from dagrl.roles.advantage import group_index
from dagrl.roles.registry import NodeContext, register_role


def _count_groups(batch: Batch) -> int:
    return len(set(batch["uid"].tolist())) if len(batch) else 0


# A follower: in trainer.mode=async it runs on the rollout ranks, where `ctx.more()` can read
# and generate fresh prompts (the trainer ranks read none).
@register_role("filter", side="follower")
def filter_groups(ctx: NodeContext, batch: Batch) -> Batch:
    """DAPO dynamic sampling: keep groups whose rewards vary (a group that is all right or all
    wrong has zero advantage and only dilutes the batch); generate again on fresh prompts until
    data.train_batch_size groups are kept over all ranks, at most algorithm.filter_max_rounds
    rounds. Every rank takes the same decisions, from globally summed counts."""
    algo, target = ctx.config.algorithm, ctx.config.data.train_batch_size
    rounds_kept = [_with_variance(batch)]    # this rank's kept groups, round by round
    kept, generated = _count_groups(rounds_kept[0]), _count_groups(batch)
    while True:
        counts = ctx.reduce_sum(torch.tensor([kept, generated], dtype=torch.float64))
        total = int(counts[0])
        if total >= target or len(rounds_kept) >= algo.filter_max_rounds or ctx.more is None:
            break
        fresh = ctx.more()
        rounds_kept.append(_with_variance(fresh))
        kept, generated = kept + _count_groups(rounds_kept[-1]), generated + _count_groups(fresh)
    ctx.metrics.add_max("filter/rounds", len(rounds_kept))
    ctx.metrics.add_mean("filter/keep_rate", kept, generated)
    keep = target
    if total < target:
        if algo.filter_on_cap == "error" or total < ctx.world_size:
            raise RuntimeError(
                f"node {ctx.node.id!r}: only {total} of {target} groups had varying rewards after "
                f"{len(rounds_kept)} generation round(s) (algorithm.filter_max_rounds="
                f"{algo.filter_max_rounds}); raise it, or set algorithm.filter_on_cap=partial")
        keep = total - total % ctx.world_size   # equal group counts per rank for the update
        ctx.engines.log(f"filter: training on a partial batch of {keep}/{target} groups")
    batch = _first_groups(ctx, rounds_kept, keep)
    ctx.metrics.add_sum("filter/groups_kept", _count_groups(batch))
    return batch


def _with_variance(batch: Batch) -> Batch:
    return batch.select(groups_with_variance(batch["scores"],
                                             group_index(batch["uid"], batch["scores"].device)))


def _first_groups(ctx: NodeContext, rounds_kept: list[Batch], keep: int) -> Batch:
    """Keep the first `keep` groups of the global order: round by round, and within a round
    rank by rank (each rank reads the r-th contiguous slice of a round's prompts), which is
    the order one worker generates them in, so N workers keep the groups one worker keeps."""
    world, rounds = ctx.world_size, len(rounds_kept)
    counts = torch.zeros(rounds, world, dtype=torch.float64)
    for r, b in enumerate(rounds_kept):
        counts[r, ctx.rank] = _count_groups(b)
    counts = ctx.reduce_sum(counts).flatten()     # round-major, then rank
    parts = []
    for r, b in enumerate(rounds_kept):
        before = int(counts[:r * world + ctx.rank].sum())
        allowed = max(0, min(int(counts[r * world + ctx.rank]), keep - before))
        uids = b["uid"].tolist()
        first = set(list(dict.fromkeys(uids))[:allowed])
        parts.append(b.select([i for i, u in enumerate(uids) if u in first]))
    return Batch.concat(parts)
