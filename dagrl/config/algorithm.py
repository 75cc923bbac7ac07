"""The `algorithm` section: which estimator, policy loss, aggregation and KL terms a run uses
(verl's names; docs/algorithms.md lists them), their settings, and the rollout correction.

Registered names are checked at load by `check_registered_names` (dagrl/runtime/config_names.py;
the registries live in dagrl/algorithms, above this layer); what can be checked here is checked in
`__post_init__`, with messages that start with the field name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dagrl.config.loader import require

# The advantage estimators that read the old policy's per-token statistics (old_logprobs and
# sum_pi_squared): the built-in graphs run the old_logprob pass for them, and that pass computes
# sum_pi_squared. (The estimators live in dagrl/algorithms, above this layer, which keeps the
# same tuple as OLD_POLICY_ESTIMATORS; a test checks that the two agree.)
OLD_POLICY_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")


def _positive_bounds(spec: str | float) -> bool:
    """"U" or "L_U" with numbers 0 < L <= U (the form of the rollout IS threshold)."""
    lower, _, upper = str(spec).strip().rpartition("_")
    try:
        u, low = float(upper), float(lower) if lower else None
    except ValueError:
        return False
    return u > 0 and (low is None or 0 < low <= u)


@dataclass
class RolloutCorrectionConfig:
    """Correction for the mismatch between the rollout engine's policy and the trainer's
    (verl's `algorithm.rollout_correction`, dagrl/algorithms/rollout_correction.py). Needs the
    rollout's log-probs (every backend records them). With a policy loss other than bypass_mode,
    the old_logprob node computes the weights and the rejection mask once per batch, from
    pi_old vs the rollout; with policy_loss=bypass_mode the loss computes them from the current
    policy, and pi_old is the rollout policy."""
    # Importance weights pi_train / pi_rollout per "token" or per "sequence"; "" = none.
    rollout_is: Literal["", "token", "sequence"] = ""
    # "U": truncate the weights at U (TIS); "L_U": zero the weights outside [L, U] (IcePop).
    rollout_is_threshold: str | float = 2.0
    # Divide the weights by their batch mean.
    rollout_is_batch_normalize: bool = False
    # Rejection sampling: comma-separated options such as "token_k1,seq_mean_k3" (a
    # reduction token / seq_sum / seq_mean / seq_max and a divergence k1 / k2 / k3); "" = none.
    rollout_rs: str = ""
    # One threshold, or one per rollout_rs option (comma-separated); k1 options take ratio
    # bounds "L_U" or "U" (L = 1/U), k2 / k3 options an upper bound.
    rollout_rs_threshold: str | float = ""
    # policy_loss=bypass_mode only: PPO's clipped loss against the rollout policy, or REINFORCE
    # with the IS weights.
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"

    def __post_init__(self) -> None:
        require(_positive_bounds(self.rollout_is_threshold),
               f"rollout_is_threshold must be 'U' or 'L_U' with numbers 0 < L <= U, got "
               f"{self.rollout_is_threshold!r}")
        require(bool(self.rollout_rs) == (str(self.rollout_rs_threshold).strip() != ""),
               "rollout_rs and rollout_rs_threshold go together: set both or neither")
        # The option names and per-option thresholds are checked against the registry at load
        # (dagrl.runtime.config_names.check_registered_names), above this layer.

    @property
    def active(self) -> bool:
        return bool(self.rollout_is or self.rollout_rs)


@dataclass
class AlgorithmConfig:
    name: str = "grpo"              # selects the built-in DAG (dagrl plan shows it)
    # verl's names (docs/algorithms.md lists them all): grpo, grpo_vectorized, rloo,
    # rloo_vectorized, opo, gpg, grpo_passk, gdpo, reinforce_plus_plus(_baseline), remax, gae,
    # optimal_token_baseline, tir_optimal_token_baseline; and siiRL's cpgd.
    adv_estimator: str = "grpo"
    # GRPO (and grpo_passk, gdpo, cpgd): divide by the group std; False is Dr.GRPO's choice.
    norm_adv_by_std: bool = True
    # verl's names: vanilla, gspo, sapo, geo_mean, cispo, dppo_tv, dppo_kl, gpg, reinforce,
    # dro, clip_cov, kl_cov, bypass_mode; and siiRL's cpgd.
    policy_loss: str = "vanilla"
    # The ratio clip 1 - clip_ratio_low .. 1 + clip_ratio_high (DPPO: the divergence bounds).
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0       # dual clip bound for negative advantages; DPPO's IS cap
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum",
                           "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coeff: float = 0.0
    # CPGD's policy-drift penalty weight (used by policy_loss=cpgd).
    policy_drift_coef: float = 0.01
    # Clip-Cov (policy_loss=clip_cov): the share of tokens whose gradient is cut, drawn from
    # those whose advantage-logprob covariance lies in (clip_cov_lb, clip_cov_ub).
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    # KL-Cov (policy_loss=kl_cov): the share of tokens (largest covariance) that get the
    # penalty ppo_kl_coef * |log ratio|.
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    # SAPO (policy_loss=sapo): the soft gate's temperatures for positive / other advantages.
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    # DRO (policy_loss=dro): the weight beta of the 1/2 * beta * (log ratio)^2 penalty; > 0.
    dro_beta: float = 0.0
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # GDPO (adv_estimator=gdpo): the reward components, by the keys the scorer returns in its
    # dict, each normalised within its group; empty: the total score is the only component.
    gdpo_reward_keys: list[str] = field(default_factory=list)
    # ... and their weights (empty: 1 each).
    gdpo_reward_weights: list[float] = field(default_factory=list)
    # KL to the reference policy as a loss term (GRPO's choice). 0 disables the term, and the
    # reference model is then not needed by the update.
    kl_loss_coef: float = 0.001
    # k1/kl, k2/mse, k3/low_var_kl, abs, and their straight-through "+" forms (k3+: k3's value,
    # k2's gradient).
    kl_loss_type: str = "low_var_kl"
    # KL to the reference as a per-token reward penalty r_t -= beta * KL_t (PPO/RLOO/REINFORCE++).
    kl_in_reward: bool = False
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001          # beta (the initial beta for the adaptive controller)
    kl_reward_type: str = "k1"
    # Adaptive controller: the KL it steers towards (the batch mean of the per-sequence mean
    # KL, as verl's), and the samples over which beta adapts.
    kl_target: float = 0.1
    kl_horizon: int = 10000
    # GAE (PPO) and discounted returns (REINFORCE++).
    gamma: float = 1.0
    lam: float = 1.0
    # DAPO dynamic sampling (the `filter` node): at most this many generation rounds per step to
    # fill the batch with groups whose rewards vary; then stop with an error, or train on the
    # partial batch (logged).
    filter_max_rounds: int = 4
    filter_on_cap: Literal["error", "partial"] = "error"

    def __post_init__(self) -> None:
        require(self.clip_ratio_low >= 0 and self.clip_ratio_high >= 0,
               "clip_ratio_low and clip_ratio_high must be >= 0")
        require(self.clip_ratio_c > 1, "clip_ratio_c must be > 1")
        require(self.kl_loss_coef >= 0, "kl_loss_coef must be >= 0")
        require(self.kl_coef >= 0, "kl_coef must be >= 0")
        require(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "gamma and lam must be in [0, 1]")
        require(self.kl_target > 0 and self.kl_horizon > 0, "kl_target and kl_horizon must be > 0")
        require(self.filter_max_rounds > 0, "filter_max_rounds must be > 0")
        require(0 < self.clip_cov_ratio <= 1, "clip_cov_ratio must be in (0, 1]")
        require(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb must be < clip_cov_ub")
        require(0 < self.kl_cov_ratio <= 1, "kl_cov_ratio must be in (0, 1]")
        require(self.ppo_kl_coef >= 0, "ppo_kl_coef must be >= 0")
        require(self.tau_pos > 0 and self.tau_neg > 0, "tau_pos and tau_neg must be > 0")
        require(self.dro_beta >= 0, "dro_beta must be >= 0")
        require(self.policy_loss != "dro" or self.dro_beta > 0,
               "dro_beta must be > 0 with policy_loss=dro (the weight of its log-ratio penalty)")
        require(not self.gdpo_reward_weights
               or len(self.gdpo_reward_weights) == len(self.gdpo_reward_keys),
               "gdpo_reward_weights must give one weight per gdpo_reward_keys entry "
               f"({len(self.gdpo_reward_keys)}), got {len(self.gdpo_reward_weights)}")

    @property
    def bypass_mode(self) -> bool:
        """pi_old is the rollout policy (verl's bypass mode), so no old_logprob pass is needed
        for the loss."""
        return self.policy_loss == "bypass_mode"

    @property
    def needs_old_logprob(self) -> bool:
        """The old_logprob pass is needed for the algorithm itself: the estimator reads pi_old's
        statistics, or the rollout correction is computed from pi_old (not in bypass mode)."""
        return (self.adv_estimator in OLD_POLICY_ESTIMATORS
                or (self.rollout_correction.active and not self.bypass_mode))
