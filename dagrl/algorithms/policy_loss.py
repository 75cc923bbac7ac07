"""Per-token policy-gradient losses, looked up by name from ``POLICY_LOSSES``.

Every loss has the signature::

    fn(logprobs [B, T], old_logprobs [B, T], advantages [B, T], response_mask [B, T], *,
       clip_ratio_low, clip_ratio_high, clip_ratio_c) -> (loss_mat [B, T], stats)

``loss_mat`` is the per-token loss (zero outside the mask); reducing it to a scalar is the job of
``dagrl.algorithms.loss_agg.agg_loss``. ``stats`` maps names to detached per-token [B, T] tensors
(zero outside the mask) that the caller averages over the mask.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dagrl.registry import Registry

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

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
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
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
