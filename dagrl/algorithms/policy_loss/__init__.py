"""Per-token policy-gradient losses, looked up by name (verl's names) from ``POLICY_LOSSES``.

    base.py          PolicyLossParams, the registry, pinned aggregation modes, helpers
    ratio.py         on the importance ratio: vanilla, gspo, geo_mean (GMPO), cispo, sapo
    log_prob.py      on log π: reinforce, gpg, dro, cpgd
    trust_region.py  divergence trust regions: dppo_tv, dppo_kl
    covariance.py    entropy-preserving: clip_cov, kl_cov
    bypass.py        bypass_mode (π_old = the rollout policy, rollout correction in the loss)
"""

from __future__ import annotations

from dagrl.algorithms.policy_loss.base import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossParams,
    pinned_agg_mode,
)
from dagrl.algorithms.policy_loss.bypass import bypass_mode_policy_loss
from dagrl.algorithms.policy_loss.covariance import clip_cov_policy_loss, kl_cov_policy_loss
from dagrl.algorithms.policy_loss.log_prob import (
    CPGD_DRIFT_CLIP,
    cpgd_policy_loss,
    dro_policy_loss,
    gpg_policy_loss,
    reinforce_policy_loss,
)
from dagrl.algorithms.policy_loss.ratio import (
    cispo_policy_loss,
    geo_mean_policy_loss,
    gspo_policy_loss,
    sapo_policy_loss,
    vanilla_policy_loss,
)
from dagrl.algorithms.policy_loss.trust_region import dppo_kl_policy_loss, dppo_tv_policy_loss

__all__ = [
    "CPGD_DRIFT_CLIP",
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossParams",
    "bypass_mode_policy_loss",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "cpgd_policy_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "geo_mean_policy_loss",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "pinned_agg_mode",
    "reinforce_policy_loss",
    "sapo_policy_loss",
    "vanilla_policy_loss",
]
