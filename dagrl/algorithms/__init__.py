"""Pure-torch RL math: advantages, policy and value losses, KL estimators and control, reward
shaping, loss aggregation."""

from __future__ import annotations

from dagrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    OLD_POLICY_ESTIMATORS,
    AdvantageInputs,
    compute_cpgd_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    group_mean_std,
)
from dagrl.algorithms.kl import KL_ESTIMATORS, kl_abs, kl_k1, kl_k2, kl_k3, kl_penalty
from dagrl.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
)
from dagrl.algorithms.loss_agg import LOSS_AGG, LOSS_AGG_MODES, agg_denominator, agg_loss
from dagrl.algorithms.policy_loss import (
    CPGD_DRIFT_CLIP,
    POLICY_LOSSES,
    PolicyLossParams,
    cpgd_policy_loss,
    gspo_policy_loss,
    pinned_agg_mode,
    vanilla_policy_loss,
)
from dagrl.algorithms.rollout_correction import RolloutCorrectionParams, rollout_correction
from dagrl.algorithms.shaping import groups_with_variance, overlong_penalty
from dagrl.algorithms.utils import (
    Reducer,
    entropy_from_logits,
    global_masked_whiten,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from dagrl.algorithms.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CPGD_DRIFT_CLIP",
    "KL_ESTIMATORS",
    "LOSS_AGG",
    "LOSS_AGG_MODES",
    "OLD_POLICY_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "PolicyLossParams",
    "RolloutCorrectionParams",
    "AdaptiveKLController",
    "FixedKLController",
    "Reducer",
    "agg_denominator",
    "agg_loss",
    "apply_kl_penalty",
    "clipped_value_loss",
    "compute_cpgd_advantages",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "cpgd_policy_loss",
    "entropy_from_logits",
    "global_masked_whiten",
    "group_mean_std",
    "groups_with_variance",
    "gspo_policy_loss",
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
    "overlong_penalty",
    "pinned_agg_mode",
    "rollout_correction",
    "vanilla_policy_loss",
]
