"""Forward-only roles: log-probs of the responses under the actor before its update
(`old_logprob`) and under the reference (`ref_logprob`), and the critic's values (`values`).

Fields added for N samples, response width R: old_logprobs / ref_logprobs / values [N, R]
(and, for the algorithms that ask for them, sum_pi_squared and rollout_is_weights [N, R]).
"""

from __future__ import annotations

from dagrl.algorithms.rollout_correction import is_threshold_hits, rollout_correction
from dagrl.config.schema import OLD_POLICY_ESTIMATORS
from dagrl.data.batch import Batch
from dagrl.engines.actor import rollout_correction_params
from dagrl.engines.forward import batch_logprobs
from dagrl.engines.precision import autocast
from dagrl.roles.registry import NodeContext, register_role
from dagrl.rollout.sampling import logprob_temperature


@register_role("old_logprob", engines=("actor",), runs_model=True,
               adds={"old_logprobs": "R float32"})
def old_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    """old_logprobs [N, R]; also sum_pi_squared [N, R] for the estimators that read it, and
    with algorithm.rollout_correction (not in bypass mode) the rollout IS weights
    rollout_is_weights [N, R] and the response mask after rejection sampling."""
    algo = ctx.config.algorithm
    old, sum_sq = ctx.engines.actor.compute_logprobs(
        batch, with_sum_pi_squared=algo.adv_estimator in OLD_POLICY_ESTIMATORS)
    batch["old_logprobs"] = old
    if sum_sq is not None:
        batch["sum_pi_squared"] = sum_sq
    if "rollout_logprobs" in batch:
        # Rollout and training compute the same quantity: a gap means a numerics mismatch.
        mask = batch["response_mask"]
        gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * mask
        ctx.metrics.add_mean("actor/rollout_logprob_gap", float(gap.sum()), float(mask.sum()))
    if algo.rollout_correction.active and not algo.bypass_mode:
        _rollout_correction(ctx, batch)
    return batch


def _rollout_correction(ctx: NodeContext, batch: Batch) -> None:
    """verl's decoupled rollout correction, once per batch: weights from pi_old vs the rollout
    policy (their batch mean over all ranks), and rejected tokens dropped from the mask."""
    if "rollout_logprobs" not in batch:
        raise KeyError(f"node {ctx.node.id!r}: algorithm.rollout_correction needs the rollout's "
                       "log-probs ('rollout_logprobs'), and the batch has none")
    mask = batch["response_mask"]
    weights, kept = rollout_correction(
        batch["old_logprobs"] - batch["rollout_logprobs"], mask,
        rollout_correction_params(ctx.config.algorithm.rollout_correction),
        reducer=ctx.reduce_sum)
    tokens = float(mask.sum())
    ctx.metrics.add_mean("rollout_corr/rs_masked_fraction", tokens - float(kept.sum()), tokens)
    if weights is not None:
        ctx.metrics.add_mean("rollout_corr/is_weight_mean", float((weights * mask).sum()), tokens)
        rc = ctx.config.algorithm.rollout_correction
        hits = is_threshold_hits(batch["old_logprobs"] - batch["rollout_logprobs"], mask,
                                 rc.rollout_is, str(rc.rollout_is_threshold))
        # TIS truncates the weights above U; "L_U" (IcePop, masked IS) zeroes those outside.
        name = "is_masked_fraction" if "_" in str(rc.rollout_is_threshold) else \
            "is_clipped_fraction"
        ctx.metrics.add_mean(f"rollout_corr/{name}", float(hits.sum()), tokens)
        batch["rollout_is_weights"] = weights
    batch["response_mask"] = kept


@register_role("ref_logprob", engines=("ref",), runs_model=True, side="follower",
               adds={"ref_logprobs": "R float32"})
def ref_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    # The update's autocast, so that pi_ref = pi to the bit while the weights are equal.
    with autocast(ctx.config.model.mixed_precision, batch["responses"].device):
        batch["ref_logprobs"] = batch_logprobs(
            ctx.engines.ref_model, batch, micro_batch_size=ctx.config.ref.micro_batch_size,
            temperature=logprob_temperature(ctx.config.rollout.temperature),
            chunk_tokens=ctx.config.ref.logits_chunk_tokens,
            max_tokens=ctx.config.ref.max_tokens_per_micro_batch,
            pack=ctx.config.model.pack_sequences, share_prompts=ctx.config.model.share_prompts)
    return batch


@register_role("values", engines=("critic",), runs_model=True, adds={"values": "R float32"})
def values(ctx: NodeContext, batch: Batch) -> Batch:
    batch["values"] = ctx.engines.critic.compute_values(batch)
    return batch
