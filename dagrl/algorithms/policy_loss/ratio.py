"""Losses on the importance ratio r = π/π_old with a clip or a soft gate: vanilla PPO (with
dual clip), GSPO, GMPO (``geo_mean``), CISPO and SAPO."""

from __future__ import annotations

import torch
from torch import Tensor

from dagrl.algorithms.policy_loss.base import (
    POLICY_LOSSES,
    PolicyLossParams,
    check_clip_range,
    check_shapes,
    masked_stats,
    pins_agg_mode,
    safe_ratio,
    weighted,
)


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip (DAPO's clip-higher)
    and dual clip.

    r  = exp(log π − log π_old)
    l1 = −A · r,   l2 = −A · clip(r, 1 − ε_low, 1 + ε_high),   l_clip = max(l1, l2)
    l  = ρ · (min(l_clip, −A · c)  if A < 0  else  l_clip)

    The dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL") bounds
    the loss of a negative-advantage token whose ratio has grown large, which the plain max()
    leaves unbounded. Stats: ``clip_frac`` (l2 > l1: the clip was active), ``clip_frac_lower``
    (the dual clip was active), ``ratio`` (r) and ``approx_kl`` (log π_old − log π, the k1 of
    the update).
    """
    clip_ratio_low, clip_ratio_high = params.clip_ratio_low, params.clip_ratio_high
    clip_ratio_c = params.clip_ratio_c
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low and clip_ratio_high must be >= 0, got "
            f"clip_ratio_low={clip_ratio_low}, clip_ratio_high={clip_ratio_high}"
        )
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # [B, T]
    ratio = safe_ratio(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -advantages * clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)

    stats = masked_stats(mask, clip_frac=loss_clipped > loss_unclipped,
                         clip_frac_lower=negative & (loss_clip > loss_dual),
                         ratio=ratio, approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, token form (Zheng et al. 2025, "Group Sequence Policy Optimization", GSPO-token).

    s_i   = exp((1/|y_i|) Σ_t (log π(y_t) − log π_old(y_t)))     sequence-level ratio
    s_i,t = sg[s_i] · π(y_t) / sg[π(y_t)]                         equal to s_i in value
    l_i,t = ρ · max(−A_i,t · s_i,t,  −A_i,t · clip(s_i,t, 1 − ε_low, 1 + ε_high))

    The ratio is the geometric mean of the token ratios, so one clip decision covers the whole
    sequence; the π/sg[π] factor routes ∇ = s_i·∇log π(y_t) to every token. With A_i,t = A_i
    the gradient is GSPO's sequence-level one. GSPO's clip range is far narrower than PPO's
    (3e-4 / 4e-4 in the paper) since it bounds a length-normalised ratio. No dual clip.
    log s_i,t is clamped above at 10 as in verl (exp overflow guard; past it the token's
    gradient is cut).
    Stats: ``clip_frac`` (the clipped branch was taken), ``ratio`` (s_i,t), ``approx_kl``
    (log π_old − log π per token).
    """
    clip_ratio_low, clip_ratio_high = params.clip_ratio_low, params.clip_ratio_high
    check_clip_range(clip_ratio_low, clip_ratio_high)
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # [B, T]
    seq_len = mask.sum(-1).clamp_min(1.0)  # [B] = |y_i|; an empty row divides 0 by 1
    seq_log_ratio = (log_ratio * mask).sum(-1) / seq_len  # [B] = log s_i
    log_ratio_token = (
        seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ).clamp(max=10.0)  # [B, T] = log s_i,t
    ratio = torch.exp(log_ratio_token)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)

    stats = masked_stats(mask, clip_frac=loss_clipped > loss_unclipped, ratio=ratio,
                         approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats


@POLICY_LOSSES.register("geo_mean")
@pins_agg_mode("seq-mean-token-mean")
def geo_mean_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO, Geometric-Mean Policy Optimization (arXiv 2507.20673): the sequence objective
    uses the geometric mean of the token ratios, clipped per token in log space.

    δ_t   = log π(y_t) − log π_old(y_t)
    δ̃_t   = sgn(A)·min(sgn(A)·δ_t, sgn(A)·clip(δ_t, −ε_low, ε_high))    pessimistic clip
    R_i   = exp(Σ_t δ̃_t·m_t / |y_i|),   Â_i = Σ_t A_t·m_t / |y_i|
    ρ̄_i   = exp(Σ_t log(ρ_t + 1e-10)·m_t / |y_i|)                       (with IS weights)
    l_i   = −Â_i · R_i · ρ̄_i

    The geometric mean is far less sensitive to one outlier token ratio than GRPO's arithmetic
    mean, which allows the wider clip (the paper's (e^−0.4, e^0.4)). The loss is a sequence loss:
    it pins "seq-mean-token-mean" and puts l_i on each of the sequence's tokens, so the
    aggregate is mean_i l_i over the rows with a token (verl: ``torch.mean`` over the rows).
    Stats: ``clip_frac`` (δ clipped where A > 0), ``clip_frac_lower`` (... where A < 0),
    ``approx_kl`` (−δ).
    """
    clip_ratio_low, clip_ratio_high = params.clip_ratio_low, params.clip_ratio_high
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # [B, T] = δ
    sign = torch.sign(advantages)
    clipped = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [B, T] = δ̃
    length = mask.sum(-1)  # [B] = |y_i|
    seq_ratio = torch.exp((pessimistic * mask).sum(-1) / (length + 1e-8))  # [B] = R_i
    seq_adv = (advantages * mask).sum(-1) / (length + 1e-8)  # [B] = Â_i
    seq_loss = -seq_adv * seq_ratio  # [B] = l_i
    if rollout_is_weights is not None:
        seq_weight = torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(-1)
                               / (length + 1e-8))  # [B] = ρ̄_i
        seq_loss = seq_loss * seq_weight

    was_clipped = log_ratio != clipped
    stats = masked_stats(mask, clip_frac=was_clipped & (advantages > 0),
                         clip_frac_lower=was_clipped & (advantages < 0), approx_kl=-log_ratio)
    return seq_loss.unsqueeze(-1) * mask, stats


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO, clipped IS-weight policy optimisation (MiniMax 2025, "MiniMax-M1", arXiv
    2506.13585): clip the importance weight, not the update.

    r   = exp(clip(log π − log π_old, ±20))
    l_t = −ρ · sg[clip(r, 1 − ε_low, 1 + ε_high)] · A · log π(y_t)

    Every token keeps a gradient ∇log π (PPO's clip zeroes it for the clipped tokens, often the
    rare "fork" tokens that matter); only its weight is bounded. Stats: ``clip_frac`` (r was
    clipped), ``ratio`` (r), ``approx_kl`` (log π_old − log π).
    """
    clip_ratio_low, clip_ratio_high = params.clip_ratio_low, params.clip_ratio_high
    check_clip_range(clip_ratio_low, clip_ratio_high)
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)

    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = -clipped_ratio.detach() * advantages * logprobs

    stats = masked_stats(mask, clip_frac=ratio != clipped_ratio, ratio=ratio,
                         approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats


@POLICY_LOSSES.register("sapo")
@pins_agg_mode("seq-mean-token-mean")
def sapo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO, Soft Adaptive Policy Optimization (arXiv 2511.20347): a smooth gate on the token
    ratio in place of the hard clip.

    r      = exp(clip(log π − log π_old, ±20))
    τ      = τ_pos if A > 0 else τ_neg
    f(r)   = σ(τ·(r − 1)) · 4/τ                 (f(1) = 2/τ, f'(1) = 1: on-policy it is the
                                                 plain policy gradient)
    l_t    = −ρ · f(r) · A

    The gate's slope ∝ σ'(τ(r − 1)) decays smoothly as r leaves 1, instead of dropping to zero
    at a clip boundary; τ_neg > τ_pos damps negative updates faster. SAPO is defined on
    sequence means: it pins "seq-mean-token-mean" (as verl does, whatever the configured mode).
    Stats: ``ratio`` (r), ``approx_kl`` (log π_old − log π).
    """
    if params.tau_pos <= 0 or params.tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got tau_pos={params.tau_pos}, "
                         f"tau_neg={params.tau_neg}")
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                 response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    mask = response_mask.to(logprobs.dtype)

    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(params.tau_pos, dtype=advantages.dtype)
    tau_neg = torch.as_tensor(params.tau_neg, dtype=advantages.dtype)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * advantages

    stats = masked_stats(mask, ratio=ratio, approx_kl=-log_ratio)
    return weighted(loss, rollout_is_weights) * mask, stats
