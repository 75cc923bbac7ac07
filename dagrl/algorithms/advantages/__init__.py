"""Advantage estimators, looked up by name (verl's names) from ``ADVANTAGE_ESTIMATORS``.

    base.py     AdvantageInputs, the registry, input checks, group statistics, reward-to-go
    group.py    one baseline per prompt group: grpo(_vectorized), rloo(_vectorized), opo, gpg,
                grpo_passk, gdpo, cpgd
    returns.py  returns along the tokens: reinforce_plus_plus(_baseline), remax, gae
    otb.py      a baseline per token and group: optimal_token_baseline, tir_optimal_token_baseline
"""

from __future__ import annotations

from dagrl.algorithms.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    group_mean_std,
    reward_to_go,
)
from dagrl.algorithms.advantages.group import (
    compute_cpgd_advantages,
    compute_gdpo_advantages,
    compute_gpg_advantages,
    compute_grpo_advantages,
    compute_grpo_passk_advantages,
    compute_grpo_vectorized_advantages,
    compute_opo_advantages,
    compute_rloo_advantages,
    compute_rloo_vectorized_advantages,
)
from dagrl.algorithms.advantages.otb import (
    compute_optimal_token_baseline_advantages,
    compute_tir_optimal_token_baseline_advantages,
)
from dagrl.algorithms.advantages.returns import (
    compute_gae_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
)

# The estimators that read the old policy's per-token statistics (old_logprobs and
# sum_pi_squared): the graph must run the old_logprob pass for them, and that pass must
# compute sum_pi_squared. dagrl/config/schema.py keeps the same list (config sits below this
# layer); a test checks that the two agree.
OLD_POLICY_ESTIMATORS: tuple[str, ...] = ("optimal_token_baseline", "tir_optimal_token_baseline")

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "OLD_POLICY_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "compute_cpgd_advantages",
    "compute_gae_advantages",
    "compute_gdpo_advantages",
    "compute_gpg_advantages",
    "compute_grpo_advantages",
    "compute_grpo_passk_advantages",
    "compute_grpo_vectorized_advantages",
    "compute_opo_advantages",
    "compute_optimal_token_baseline_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_rloo_vectorized_advantages",
    "compute_tir_optimal_token_baseline_advantages",
    "group_mean_std",
    "reward_to_go",
]
