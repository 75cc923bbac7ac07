"""Forward-only roles: log-probs of the responses under the actor before its update
(`old_logprob`) and under the reference (`ref_logprob`), and the critic's values (`values`).

Fields added for N samples, response width R: old_logprobs / ref_logprobs / values [N, R].
"""

from __future__ import annotations

from dagrl.data.batch import Batch
from dagrl.engines.forward import batch_logprobs
from dagrl.engines.precision import autocast
from dagrl.roles.registry import NodeContext, register_role
from dagrl.rollout.sampling import logprob_temperature


@register_role("old_logprob", engines=("actor",))
def old_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    batch["old_logprobs"] = ctx.engines.actor.compute_logprobs(batch)
    if "rollout_logprobs" in batch:
        # Rollout and training compute the same quantity: a gap means a numerics mismatch.
        mask = batch["response_mask"]
        gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * mask
        ctx.metrics.add_mean("actor/rollout_logprob_gap", float(gap.sum()), float(mask.sum()))
    return batch


@register_role("ref_logprob", engines=("ref",))
def ref_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    # The update's autocast, so that pi_ref = pi to the bit while the weights are equal.
    with autocast(ctx.config.model.mixed_precision, batch["responses"].device):
        batch["ref_logprobs"] = batch_logprobs(
            ctx.engines.ref_model, batch, micro_batch_size=ctx.config.ref.micro_batch_size,
            temperature=logprob_temperature(ctx.config.rollout.temperature),
            chunk_tokens=ctx.config.ref.logits_chunk_tokens,
            max_tokens=ctx.config.ref.max_tokens_per_micro_batch,
            pack=ctx.config.model.pack_sequences)
    return batch


@register_role("values", engines=("critic",))
def values(ctx: NodeContext, batch: Batch) -> Batch:
    batch["values"] = ctx.engines.critic.compute_values(batch)
    return batch
