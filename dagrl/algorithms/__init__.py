"""Pure-torch RL math: advantages, policy losses, KL estimators, loss aggregation."""

from __future__ import annotations

from dagrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_grpo_advantages,
    group_mean_std,
)
from dagrl.algorithms.kl import KL_ESTIMATORS, kl_abs, kl_k1, kl_k2, kl_k3, kl_penalty
from dagrl.algorithms.loss_agg import LOSS_AGG_MODES, agg_denominator, agg_loss
from dagrl.algorithms.policy_loss import POLICY_LOSSES, vanilla_policy_loss
from dagrl.algorithms.utils import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "agg_denominator",
    "agg_loss",
    "compute_grpo_advantages",
    "entropy_from_logits",
    "group_mean_std",
    "kl_abs",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "vanilla_policy_loss",
]
