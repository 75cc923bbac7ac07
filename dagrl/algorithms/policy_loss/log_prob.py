"""Losses on log π itself (no importance ratio in the gradient's weight, or a fixed one):
REINFORCE, GPG, DRO and CPGD."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dagrl.algorithms.policy_loss.base import (
    POLICY_LOSSES,
    PolicyLossParams,
    check_clip_range,
    check_shapes,
    masked_stats,
    safe_ratio,
    weighted,
)


@POLICY_LOSSES.register("reinforce")
def reinforce_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE (Williams 1992) with optional rollout importance weights.

    l_t = −ρ_t · A_t · log π(y_t)          ∇l = −ρ·A·∇log π

    No clip and no ratio to π_old (which only enters the ``approx_kl`` stat): the plain policy
    gradient, IS-corrected by ρ = π_train/π_rollout when the rollout and the trainer differ.
    This is verl's ``compute_policy_loss_reinforce`` (there reached through ``bypass_mode`` with
    ``loss_type=reinforce``); dagrl also registers it on its own.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)
    loss = -advantages * logprobs
    stats = masked_stats(mask, approx_kl=old_logprobs - logprobs)
    return weighted(loss, rollout_is_weights) * mask, stats


@POLICY_LOSSES.register("gpg")
def gpg_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient.

    l_t = −ρ_t · A_t · log π(y_t)

    The same per-token loss as ``reinforce``: GPG drops the surrogate, the clip, the critic and
    the reference; its changes are in the advantage (``adv_estimator=gpg``). Stats:
    ``approx_kl`` (log π_old − log π).
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)
    loss = -logprobs * advantages
    stats = masked_stats(mask, approx_kl=old_logprobs - logprobs)
    return weighted(loss, rollout_is_weights) * mask, stats


@POLICY_LOSSES.register("dro")
def dro_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO, Direct Reward Optimization (Richemond et al. 2024, "Offline Regularised RL for LLM
    Alignment", arXiv 2405.19107): the policy gradient with a quadratic trust region.

    l_t = −ρ_t · (A_t · log π(y_t) − ½·β·(log π(y_t) − log π_old(y_t))²)

    ∇l = −(A − β·log r)·∇log π: the drift log r = log π/π_old pulls the update back in
    proportion to β (``algorithm.dro_beta``, required > 0), a soft form of PPO's clip.
    Stats: ``approx_kl`` (log π_old − log π).
    """
    beta = params.dro_beta
    if beta <= 0:
        raise ValueError(f"dro_beta must be > 0 for the dro loss, got {beta}")
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    loss = -(logprobs * advantages - 0.5 * beta * log_ratio.square())
    stats = masked_stats(mask, approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats


# CPGD's cap c on the policy-drift coefficient sg(r) − 1: siiRL hard-codes it as 2.0
# (dp_actor.py) and the authors' code (MM-EUREKA, --policy_drift_clip_eps) defaults to 2.0.
CPGD_DRIFT_CLIP = 2.0


@POLICY_LOSSES.register("cpgd")
def cpgd_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CPGD per-token loss (Liu et al. 2025, "CPGD: Toward Stable Rule-based Reinforcement
    Learning for Language Models", Sec. 4.3, eq. 2), i.e. −(Φ_i − α·E_i):

    Φ_i = min(ln r_i · A_i,  clip(ln r_i, ln(1 − ε_low), ln(1 + ε_high)) · A_i)
    E_i = min(sg(r_i) − 1, c) · ln π(y_i)
    l_i = ρ_i · (−Φ_i + α · E_i),           r_i = π(y_i) / π_old(y_i)

    Φ is the policy-gradient objective ln π · A (no importance ratio, whose variance drives
    collapse) with PPO's clip moved to log space: the gradient is zero once the ratio leaves
    [1 − ε_low, 1 + ε_high] in the advantage's direction. E is the policy drift, a forward
    KL(π_old ‖ π) penalty: ∇E = (r − 1)·∇ln π is the gradient of the k3 estimate r − 1 − ln r
    (eq. 5). Capping the *coefficient* at c = ``CPGD_DRIFT_CLIP`` (not the estimate) keeps a
    restoring gradient of c·∇ln π when the ratio runs away, and bounds it.
    ``params.drift_coef`` = α; 0.01 is the default and the value of the CPGD scripts in the
    authors' repository (ModalMinds/MM-EUREKA, ``--policy_drift_coef``); siiRL's examples use
    0.001. There is no dual clip. (Not a verl loss; siiRL's.)
    Stats: ``clip_frac`` (the clipped branch of Φ was taken), ``ratio`` (r), ``approx_kl``
    (log π_old − log π, the k1 estimate of the drift).
    """
    clip_ratio_low, clip_ratio_high = params.clip_ratio_low, params.clip_ratio_high
    drift_coef = params.drift_coef
    check_clip_range(clip_ratio_low, clip_ratio_high)
    if drift_coef < 0:
        raise ValueError(f"drift_coef must be >= 0, got {drift_coef}")
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # [B, T] = ln r
    obj_unclipped = log_ratio * advantages
    bounds = math.log(1.0 - clip_ratio_low), math.log(1.0 + clip_ratio_high)
    obj_clipped = log_ratio.clamp(*bounds) * advantages
    objective = torch.minimum(obj_unclipped, obj_clipped)  # [B, T] = Φ

    ratio = safe_ratio(log_ratio.detach())  # sg(r)
    drift = (ratio - 1.0).clamp(max=CPGD_DRIFT_CLIP) * logprobs  # [B, T] = E
    loss = -objective + drift_coef * drift

    stats = masked_stats(mask, clip_frac=obj_clipped < obj_unclipped, ratio=ratio,
                         approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats
