"""Training roles: one update of the actor (then its new weights go to the rollout engine)
and of the critic. Both are `trains=True`, so with several workers the planner balances tokens
across ranks before them.
"""

from __future__ import annotations

from dagrl.data.batch import Batch
from dagrl.roles.registry import NodeContext, register_role


@register_role("critic_update", engines=("critic",), trains=True)
def critic_update(ctx: NodeContext, batch: Batch) -> Batch:
    ctx.engines.critic.update(batch, ctx.metrics)
    return batch


@register_role("actor_update", engines=("actor",), trains=True)
def actor_update(ctx: NodeContext, batch: Batch) -> Batch:
    ctx.engines.actor.update(batch, ctx.metrics)
    # New weights go to the rollout engine now, while every actor rank is here to gather.
    ctx.metrics.add_max("timing/weight_sync_s", ctx.engines.sync_rollout_weights())
    ctx.metrics.add_max("weight_sync/bytes", float(ctx.engines.synced_bytes))
    return batch
