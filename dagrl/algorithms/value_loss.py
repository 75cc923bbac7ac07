"""Critic loss: PPO2's clipped value regression."""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped value loss of PPO2 (OpenAI baselines ``ppo2``; Schulman et al. 2017).

    v_clip = clip(V, V_old − c, V_old + c)
    l      = ½ · max((V − R)², (v_clip − R)²)

    All inputs are [B, T]; c = ``cliprange_value``. Taking the larger of the two errors makes the
    loss pessimistic: a value that moved more than c from the rollout's estimate gets no credit
    for moving towards R, which keeps the critic's update proximal like the policy's.
    Returns (loss_mat [B, T], stats), both 0 outside the mask; stats has ``vf_clip_frac``
    (1 where the clipped error is the larger one).

    v_clip is clamped around V_old in the value's own space, as verl's ``compute_value_loss``
    does, not formed as V_old + clip(V − V_old): the two differ by an ulp, and when V lies inside
    the band the rounding of V_old + (V − V_old) could make the clipped error larger than the
    unclipped one, counting an unclipped value as clipped. Clamping V returns V itself.
    """
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    shapes = {
        "values": tuple(values.shape),
        "old_values": tuple(old_values.shape),
        "returns": tuple(returns.shape),
        "response_mask": tuple(response_mask.shape),
    }
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"value loss inputs must all have the same [B, T] shape, got {listing}")
    mask = response_mask.to(values.dtype)

    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    err_unclipped = (values - returns) ** 2  # [B, T]
    err_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * torch.maximum(err_unclipped, err_clipped)

    stats = {"vf_clip_frac": (err_clipped > err_unclipped).to(mask.dtype) * mask}
    return loss * mask, stats
