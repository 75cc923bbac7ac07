"""Per-token KL estimators between the policy π and the reference π_ref.

Each estimator maps (log π, log π_ref) of the sampled tokens to a same-shaped tensor whose
expectation under π estimates KL(π ‖ π_ref). The names follow John Schulman's note
"Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html) and verl's
``core_algos.kl_penalty``, including its straight-through ``+`` variants: the value of the
named estimator with the gradient of k2. (k1 and k3 are unbiased estimates of the KL's value
but not of its gradient as a loss on samples from π; k2's gradient E_π[(log π − log π_ref)·∇log π]
is the KL's gradient, so ``k3+`` reports k3 and trains with k2's gradient.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dagrl.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log π − log π_ref (unbiased, high variance, can be negative)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|log π − log π_ref|."""
    return (logprobs - ref_logprobs).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = ½ (log π − log π_ref)² (biased, low variance, ≥ 0)."""
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(δ) − δ − 1 with δ = log π_ref − log π, clamped to [-10, 10].

    Unbiased and ≥ 0 (since eˣ ≥ 1 + x). δ is clamped to [-20, 20] before the exp: an
    overflowing exp would give inf, and the clamp of inf backpropagates NaN (0 · inf).
    """
    delta = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(delta) - delta - 1.0).clamp(-10.0, 10.0)


def _k2_gradient(value: Tensor, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Straight-through: the forward value of ``value``, the backward of k2.

    out = k2 − sg(k2) + sg(value)   (= value in the forward pass, ∇out = ∇k2)
    """
    k2 = kl_k2(logprobs, ref_logprobs)
    return k2 - k2.detach() + value.detach()


@KL_ESTIMATORS.register("k1+", "kl+")
def kl_k1_plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1+ = k1 in value, ∇k2 in gradient (straight-through)."""
    return _k2_gradient(kl_k1(logprobs, ref_logprobs), logprobs, ref_logprobs)


@KL_ESTIMATORS.register("abs+")
def kl_abs_plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """abs+ = |log π − log π_ref| in value, ∇k2 in gradient (straight-through)."""
    return _k2_gradient(kl_abs(logprobs, ref_logprobs), logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k2+", "mse+")
def kl_k2_plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2+ = k2: k2 already has the gradient the ``+`` variants borrow (verl returns k2)."""
    return kl_k2(logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k3+", "low_var_kl+")
def kl_k3_plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3+ = k3 in value, ∇k2 in gradient (straight-through)."""
    return _k2_gradient(kl_k3(logprobs, ref_logprobs), logprobs, ref_logprobs)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the estimator registered as ``kind`` (e.g. "k1", "low_var_kl")."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty: logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape "
            f"{tuple(ref_logprobs.shape)}"
        )
    return KL_ESTIMATORS.get(kind)(logprobs, ref_logprobs)
