"""What every policy loss shares: its settings, the registry and the helpers.

Every loss has the signature::

    fn(logprobs [B, T], old_logprobs [B, T], advantages [B, T], response_mask [B, T],
       params: PolicyLossParams, rollout_is_weights: [B, T] | None = None)
       -> (loss_mat [B, T], stats)

and reads from ``params`` the settings its equation uses. ``rollout_is_weights`` (ρ, no
gradient; see ``dagrl.algorithms.rollout_correction``) multiplies the per-token loss in every
loss that takes it, as in verl.

``loss_mat`` is the per-token loss (zero outside the mask); reducing it to a scalar is the job of
``dagrl.algorithms.loss_agg.agg_loss``, with the configured ``algorithm.loss_agg_mode`` unless
the loss pins its own mode (``pinned_agg_mode``: SAPO and GMPO are defined on sequence means).
``stats`` maps names to detached per-token [B, T] tensors (zero outside the mask) that the
caller averages over the mask.

The ratio r = π/π_old is formed from log r clipped to ±20 wherever verl clips it: a stale or
diverged token can have |log r| in the hundreds, and exp would overflow to inf and poison the
batch's gradient. ±20 is far outside any clip range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from dagrl.algorithms.rollout_correction import RolloutCorrectionParams
from dagrl.registry import Registry


@dataclass(frozen=True)
class PolicyLossParams:
    """The settings of the policy losses (``algorithm.*`` of the same names)."""
    clip_ratio_low: float = 0.2     # ε_low:  the ratio is clipped below at 1 − ε_low
    clip_ratio_high: float = 0.2    # ε_high: ... and above at 1 + ε_high (DAPO's clip-higher)
    clip_ratio_c: float = 3.0       # the dual-clip bound c of the vanilla loss; DPPO's IS cap
    drift_coef: float = 0.01        # CPGD's policy-drift weight α
    clip_cov_ratio: float = 0.0002  # Clip-Cov: share of tokens whose gradient is cut
    clip_cov_lb: float = 1.0        # Clip-Cov: the covariance window (lb, ub) they come from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002    # KL-Cov: share of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1        # KL-Cov: the penalty's weight
    tau_pos: float = 1.0            # SAPO: gate temperature for A > 0
    tau_neg: float = 1.05           # SAPO: ... and for A ≤ 0
    dro_beta: float = 0.0           # DRO: weight of the ½·β·(log r)² penalty (must be > 0)
    rollout_correction: RolloutCorrectionParams = field(default_factory=RolloutCorrectionParams)


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")

F = TypeVar("F", bound=Callable)


def pins_agg_mode(mode: str) -> Callable[[F], F]:
    """Mark a loss whose equation fixes its aggregation (``pinned_agg_mode`` reads it)."""
    def mark(fn: F) -> F:
        fn.loss_agg_mode = mode  # type: ignore[attr-defined]
        return fn
    return mark


def pinned_agg_mode(fn: PolicyLoss) -> str | None:
    """The aggregation mode ``fn`` always uses, or None when it follows the config."""
    return getattr(fn, "loss_agg_mode", None)


def check_shapes(**tensors: Tensor | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"policy loss inputs must all have the same [B, T] shape, got {listing}")


def check_clip_range(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
            f"clip_ratio_low={clip_ratio_low}, clip_ratio_high={clip_ratio_high}"
        )


def safe_ratio(log_ratio: Tensor) -> Tensor:
    """r = exp(clip(log r, −20, 20))."""
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def weighted(loss: Tensor, rollout_is_weights: Tensor | None) -> Tensor:
    """The per-token loss times the rollout IS weight ρ (unchanged without weights)."""
    return loss if rollout_is_weights is None else loss * rollout_is_weights


def masked_stats(mask: Tensor, **stats: Tensor) -> dict[str, Tensor]:
    """Each stat detached, in the mask's dtype and 0 outside the mask."""
    return {name: value.detach().to(mask.dtype) * mask for name, value in stats.items()}
