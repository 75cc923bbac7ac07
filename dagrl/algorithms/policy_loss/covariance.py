"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617, Sec. 5): entropy collapse is driven by the few
tokens whose log-probability and advantage covary most, so the update is restrained on those
tokens only.

The token covariance is taken over the micro-batch's valid tokens (as in verl, which computes
it per micro-batch too):

    Cov_t = (A_t − mean(A)) · (log π(y_t) − mean(log π))

Both keep PPO's unclipped surrogate −A·r elsewhere (r = π/π_old, not clipped before exp).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dagrl.algorithms.policy_loss.base import (
    POLICY_LOSSES,
    PolicyLossParams,
    check_shapes,
    masked_stats,
    weighted,
)
from dagrl.algorithms.utils import masked_mean


@POLICY_LOSSES.register("clip_cov")
def clip_cov_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO's clipped loss, with the gradient cut on a few random high-covariance
    tokens.

    l_t  = ρ · max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) · c_t
    c_t  = 0 for ⌊κ·N⌋ (at least 1) tokens drawn uniformly (``torch.randperm``) from those
           with lb < Cov_t < ub that PPO's clip left unclipped, else 1

    κ = ``clip_cov_ratio``, (lb, ub) = (``clip_cov_lb``, ``clip_cov_ub``), N = the number of
    valid tokens. The draw uses torch's global RNG exactly as verl's does, so a seeded run
    cuts the same tokens. Stats: ``clip_frac`` (c = 0), ``ratio``, ``approx_kl``.
    """
    if params.clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {params.clip_cov_ratio}")
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)
    valid = response_mask > 0

    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - params.clip_ratio_low,
                                             1.0 + params.clip_ratio_high)
    clipped_by_ppo = (loss_clipped > loss_unclipped) & valid

    with torch.no_grad():
        cov = ((advantages - masked_mean(advantages, mask))
               * (logprobs - masked_mean(logprobs, mask)))  # [B, T] = Cov
        candidates = torch.nonzero((cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
                                   & valid & ~clipped_by_ppo)  # [K, 2], row-major
        n_cut = max(int(params.clip_cov_ratio * float(mask.sum())), 1)
        if len(candidates) > 0:
            candidates = candidates[torch.randperm(len(candidates))[:min(n_cut,
                                                                          len(candidates))]]
        keep = torch.ones_like(logprobs)
        keep[candidates[:, 0], candidates[:, 1]] = 0.0  # [B, T] = c

    loss = torch.maximum(loss_unclipped, loss_clipped) * keep
    stats = masked_stats(mask, clip_frac=keep == 0, ratio=ratio, approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats


@POLICY_LOSSES.register("kl_cov")
def kl_cov_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: the unclipped surrogate, plus a KL penalty on the highest-covariance tokens.

    l_t = ρ · (−A·r + β·|log r|)   for the ⌊κ·N⌋ (at least 1) valid tokens of largest Cov_t
    l_t = ρ · (−A·r)               elsewhere

    κ = ``kl_cov_ratio``, β = ``ppo_kl_coef``, N = the number of valid tokens.
    Stats: ``ratio``, ``approx_kl`` (log π_old − log π).
    """
    if params.kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {params.kl_cov_ratio}")
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)
    valid = response_mask > 0

    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    loss_plain = -advantages * ratio
    loss_kl = loss_plain + params.ppo_kl_coef * log_ratio.abs()

    with torch.no_grad():
        penalised = torch.zeros_like(valid)  # [B, T] bool
        adv, logp = advantages[valid], logprobs[valid]  # [N] each, row-major
        if adv.numel() > 0:
            cov = (adv - adv.mean()) * (logp - logp.mean())  # [N] = Cov over the valid tokens
            n_pen = max(1, int(adv.numel() * params.kl_cov_ratio))
            top = torch.topk(cov, n_pen, largest=True).indices
            flat = torch.zeros(adv.numel(), dtype=torch.bool, device=adv.device)
            flat[top] = True
            penalised[valid] = flat

    loss = torch.where(penalised, loss_kl, loss_plain)
    stats = masked_stats(mask, ratio=ratio, approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats
