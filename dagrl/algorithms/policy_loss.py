"""Per-token policy-gradient losses, looked up by name from ``POLICY_LOSSES``.

Every loss has the signature::

    fn(logprobs [B, T], old_logprobs [B, T], advantages [B, T], response_mask [B, T],
       params: PolicyLossParams) -> (loss_mat [B, T], stats)

and reads from ``params`` the settings its equation uses.

``loss_mat`` is the per-token loss (zero outside the mask); reducing it to a scalar is the job of
``dagrl.algorithms.loss_agg.agg_loss``. ``stats`` maps names to detached per-token [B, T] tensors
(zero outside the mask) that the caller averages over the mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dagrl.registry import Registry


@dataclass(frozen=True)
class PolicyLossParams:
    """The settings of the policy losses (``algorithm.*`` of the same names)."""
    clip_ratio_low: float = 0.2     # ε_low:  the ratio is clipped below at 1 − ε_low
    clip_ratio_high: float = 0.2    # ε_high: ... and above at 1 + ε_high (DAPO's clip-higher)
    clip_ratio_c: float = 3.0       # the dual-clip bound c of the vanilla loss
    drift_coef: float = 0.01        # CPGD's policy-drift weight α


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossParams],
                      tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _check_shapes(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"policy loss inputs must all have the same [B, T] shape, got {listing}")


@POLICY_LOSSES.register("vanilla", "ppo")
def vanilla_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual clip.

    r  = exp(log π − log π_old)
    l1 = −A · r,   l2 = −A · clip(r, 1 − ε_low, 1 + ε_high),   l_clip = max(l1, l2)
    l  = min(l_clip, −A · c)  if A < 0  else  l_clip

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
    _check_shapes(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
    )
    mask = response_mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # [B, T]
    # A stale or diverged token can have |log r| in the hundreds; exp would overflow to inf and
    # poison the whole batch's gradient. ±20 is far outside any clip range: the tokens it
    # touches have a clipped loss or one of size |A|·e⁻²⁰ anyway.
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -advantages * clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)

    stats = {
        "clip_frac": (loss_clipped > loss_unclipped).to(mask.dtype) * mask,
        "clip_frac_lower": (negative & (loss_clip > loss_dual)).to(mask.dtype) * mask,
        "ratio": ratio.detach() * mask,
        "approx_kl": -log_ratio.detach() * mask,
    }
    return loss * mask, stats


def _check_clip_range(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
            f"clip_ratio_low={clip_ratio_low}, clip_ratio_high={clip_ratio_high}"
        )


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    params: PolicyLossParams,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, token form (Zheng et al. 2025, "Group Sequence Policy Optimization", GSPO-token).

    s_i   = exp((1/|y_i|) Σ_t (log π(y_t) − log π_old(y_t)))     sequence-level ratio
    s_i,t = sg[s_i] · π(y_t) / sg[π(y_t)]                         equal to s_i in value
    l_i,t = max(−A_i,t · s_i,t,  −A_i,t · clip(s_i,t, 1 − ε_low, 1 + ε_high))

    The ratio is the geometric mean of the token ratios, so one clip decision covers the whole
    sequence; the π/sg[π] factor routes ∇ = s_i·∇log π(y_t) to every token. With A_i,t = A_i
    the gradient is GSPO's sequence-level one. GSPO's clip range is far narrower than PPO's
    (3e-4 / 4e-4 in the paper) since it bounds a length-normalised ratio. GSPO has no dual
    clip.
    Stats: ``clip_frac`` (the clipped branch was taken), ``ratio`` (s_i,t), ``approx_kl``
    (log π_old − log π per token).
    """
    clip_ratio_low, clip_ratio_high = params.clip_ratio_low, params.clip_ratio_high
    _check_clip_range(clip_ratio_low, clip_ratio_high)
    _check_shapes(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
    )
    mask = response_mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # [B, T]
    seq_len = mask.sum(-1).clamp_min(1.0)  # [B] = |y_i|; an empty row divides 0 by 1
    seq_log_ratio = (log_ratio * mask).sum(-1) / seq_len  # [B] = log s_i
    # Only the detached value is clamped (against exp overflow), so the gradient always flows.
    log_ratio_token = (
        seq_log_ratio.detach().clamp(-20.0, 20.0).unsqueeze(-1) + logprobs - logprobs.detach()
    )  # [B, T] = log s_i,t
    ratio = torch.exp(log_ratio_token)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)

    stats = {
        "clip_frac": (loss_clipped > loss_unclipped).to(mask.dtype) * mask,
        "ratio": ratio.detach() * mask,
        "approx_kl": -log_ratio.detach() * mask,
    }
    return loss * mask, stats


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """CPGD per-token loss (Liu et al. 2025, "CPGD: Toward Stable Rule-based Reinforcement
    Learning for Language Models", Sec. 4.3, eq. 2), i.e. −(Φ_i − α·E_i):

    Φ_i = min(ln r_i · A_i,  clip(ln r_i, ln(1 − ε_low), ln(1 + ε_high)) · A_i)
    E_i = min(sg(r_i) − 1, c) · ln π(y_i)
    l_i = −Φ_i + α · E_i,           r_i = π(y_i) / π_old(y_i)

    Φ is the policy-gradient objective ln π · A (no importance ratio, whose variance drives
    collapse) with PPO's clip moved to log space: the gradient is zero once the ratio leaves
    [1 − ε_low, 1 + ε_high] in the advantage's direction. E is the policy drift, a forward
    KL(π_old ‖ π) penalty: ∇E = (r − 1)·∇ln π is the gradient of the k3 estimate r − 1 − ln r
    (eq. 5). Capping the *coefficient* at c = ``CPGD_DRIFT_CLIP`` (not the estimate) keeps a
    restoring gradient of c·∇ln π when the ratio runs away, and bounds it.
    ``params.drift_coef`` = α; 0.01 is the default and the value of the CPGD scripts in the authors'
    repository (ModalMinds/MM-EUREKA, ``--policy_drift_coef``); siiRL's examples use 0.001.
    There is no dual clip.
    Stats: ``clip_frac`` (the clipped branch of Φ was taken), ``ratio`` (r), ``approx_kl``
    (log π_old − log π, the k1 estimate of the drift).
    """
    clip_ratio_low, clip_ratio_high = params.clip_ratio_low, params.clip_ratio_high
    drift_coef = params.drift_coef
    _check_clip_range(clip_ratio_low, clip_ratio_high)
    if drift_coef < 0:
        raise ValueError(f"drift_coef must be >= 0, got {drift_coef}")
    _check_shapes(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
    )
    mask = response_mask.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # [B, T] = ln r
    obj_unclipped = log_ratio * advantages
    bounds = math.log(1.0 - clip_ratio_low), math.log(1.0 + clip_ratio_high)
    clipped_log_ratio = log_ratio.clamp(*bounds)
    obj_clipped = clipped_log_ratio * advantages
    objective = torch.minimum(obj_unclipped, obj_clipped)  # [B, T] = Φ

    ratio = torch.exp(log_ratio.detach().clamp(-20.0, 20.0))  # sg(r); ±20 only guards the exp
    drift = (ratio - 1.0).clamp(max=CPGD_DRIFT_CLIP) * logprobs  # [B, T] = E
    loss = -objective + drift_coef * drift

    stats = {
        "clip_frac": (obj_clipped < obj_unclipped).to(mask.dtype) * mask,
        "ratio": ratio * mask,
        "approx_kl": -log_ratio.detach() * mask,
    }
    return loss * mask, stats
