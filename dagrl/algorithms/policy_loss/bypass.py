"""verl's ``bypass_mode``: train on the rollout engine's log-probs as π_old (no old-logprob
forward pass: two policies instead of three), with rollout correction computed inside the loss
from the *current* policy π_θ and the rollout policy.

    δ_t   = sg[log π_θ(y_t)] − log π_rollout(y_t)
    ρ, m' = rollout_correction(δ, m)        IS weights and the mask after rejection sampling
                                            (``algorithm.rollout_correction.*``)
    loss_type "ppo_clip":  l = vanilla PPO with π_old = π_rollout on m'   (no ρ: the ratio
                           π_θ/π_rollout already is the IS ratio, and its clip bounds it)
    loss_type "reinforce": l = −ρ·A·log π_θ on m'

The actor passes the batch's ``rollout_logprobs`` as ``old_logprobs`` for this loss. The IS
batch normalisation (``rollout_is_batch_normalize``) averages over this micro-batch on this
rank: verl all-reduces it over the data-parallel ranks inside the loss, a collective dagrl
does not place in the micro-batch loop (ranks may hold different numbers of micro-batches).
"""

from __future__ import annotations

from torch import Tensor

from dagrl.algorithms.policy_loss.base import POLICY_LOSSES, PolicyLoss, PolicyLossParams
from dagrl.algorithms.policy_loss.log_prob import reinforce_policy_loss
from dagrl.algorithms.policy_loss.ratio import vanilla_policy_loss
from dagrl.algorithms.rollout_correction import rollout_correction
from dagrl.registry import Registry

# loss_type -> (the loss, whether it takes the IS weights)
BYPASS_LOSS_TYPES: Registry[tuple[PolicyLoss, bool]] = Registry("bypass_mode loss_type")
BYPASS_LOSS_TYPES.add("ppo_clip", (vanilla_policy_loss, False))
BYPASS_LOSS_TYPES.add("reinforce", (reinforce_policy_loss, True))


@POLICY_LOSSES.register("bypass_mode")
def bypass_mode_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bypass mode (see the module docstring): ``old_logprobs`` are the rollout log-probs.

    ρ, m' = rollout_correction(sg[log π_θ] − log π_rollout, m)
    l     = vanilla(π_θ, π_rollout, A, m')          loss_type = "ppo_clip"
    l     = −ρ · A · log π_θ · m'                   loss_type = "reinforce"

    ``rollout_is_weights`` passed in are ignored: the weights are recomputed from π_θ, as in
    verl. Rejected tokens contribute 0 to the loss; the aggregation's denominator still counts
    them (the caller's global denominator comes from the mask before rejection, as verl's
    ``global_batch_info`` does). Stats: the inner loss's, plus ``rollout_rejected`` (1 where
    rejection sampling dropped the token).
    """
    correction = params.rollout_correction
    loss_fn, takes_weights = BYPASS_LOSS_TYPES.get(correction.loss_type)
    weights, kept = rollout_correction(logprobs.detach() - old_logprobs, response_mask,
                                       correction)
    loss_mat, stats = loss_fn(logprobs, old_logprobs, advantages, kept, params,
                              rollout_is_weights=weights if takes_weights else None)
    mask = response_mask.to(logprobs.dtype)
    stats["rollout_rejected"] = (mask - kept.to(mask.dtype)).detach()
    return loss_mat, stats
