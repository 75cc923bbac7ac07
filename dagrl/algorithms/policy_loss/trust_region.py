"""DPPO: PPO's ratio clip replaced by a trust region on a divergence between the old and new
token probabilities ("DPPO-Binary-TV" and "DPPO-Binary-KL" of arXiv 2602.04879, the paper
verl's implementation cites; its Sec. 5.4 motivates the truncated IS weight).

Both losses share one form; only the region differs:

    p = π(y_t), p_old = π_old(y_t),  r = exp(clip(log p − log p_old, ±20))
    l_t = −ρ · A · sg[min(r, c)] · log π(y_t) · sg[v_t]

v_t ∈ {0, 1} keeps a token's gradient while its move stays inside the region *in the direction
the advantage pushes it* (a token moving back towards p_old is never cut), and sg[min(r, c)] is
a truncated importance weight (TIS; c = ``clip_ratio_c``) in place of PPO's dual clip.
``clip_ratio_low`` / ``clip_ratio_high`` are the divergence thresholds δ_low / δ_high (not ratio
bounds). Stats: ``clip_frac`` (1 − v), ``clip_frac_lower`` (r > c among the kept tokens),
``ratio`` (r), ``approx_kl`` (log p_old − log p).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dagrl.algorithms.policy_loss.base import (
    POLICY_LOSSES,
    PolicyLossParams,
    check_shapes,
    masked_stats,
    safe_ratio,
    weighted,
)


def _dppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
               response_mask: Tensor, params: PolicyLossParams, valid: Tensor,
               rollout_is_weights: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The shared DPPO form above, given the region test ``valid`` [B, T] (bool)."""
    mask = response_mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = safe_ratio(log_ratio)
    truncated = ratio.clamp(max=params.clip_ratio_c).detach()  # sg[min(r, c)]
    keep = valid.detach().to(logprobs.dtype)
    loss = -advantages * truncated * logprobs * keep
    stats = masked_stats(mask, clip_frac=1.0 - keep,
                         clip_frac_lower=(ratio > params.clip_ratio_c).to(keep.dtype) * keep,
                         ratio=ratio, approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879): a total-variation trust region on the sampled token.

    v_t = [p − p_old ≤ δ_high]   if A > 0      (a rewarded token may gain at most δ_high)
    v_t = [p − p_old ≥ −δ_low]   otherwise     (a penalised token may lose at most δ_low)
    l_t = −ρ · A · sg[min(r, c)] · log π(y_t) · v_t
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    move = torch.exp(logprobs) - torch.exp(old_logprobs)  # [B, T] = p − p_old
    valid = torch.where(advantages > 0, move <= params.clip_ratio_high,
                        move >= -params.clip_ratio_low)
    return _dppo_loss(logprobs, old_logprobs, advantages, response_mask, params, valid,
                      rollout_is_weights)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879): a KL trust region between the Bernoulli distributions
    (p_old, 1 − p_old) and (p, 1 − p) of "the sampled token vs the rest".

    D_t = p_old·(log p_old − log p) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8))
    v_t = [D_t ≤ δ_high or p ≤ p_old]   if A > 0
    v_t = [D_t ≤ δ_low  or p ≥ p_old]   otherwise
    l_t = −ρ · A · sg[min(r, c)] · log π(y_t) · v_t
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)
    binary_kl = p_old * (old_logprobs - logprobs) + (1.0 - p_old) * torch.log(
        (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))  # [B, T] = D
    valid = torch.where(advantages > 0, (binary_kl <= params.clip_ratio_high) | (p <= p_old),
                        (binary_kl <= params.clip_ratio_low) | (p >= p_old))
    return _dppo_loss(logprobs, old_logprobs, advantages, response_mask, params, valid,
                      rollout_is_weights)
