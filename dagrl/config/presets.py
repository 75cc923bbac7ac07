"""Per-algorithm defaults: `algorithm.name=X` selects X's graph *and* these settings.

A preset sits between the dataclass defaults and what the user wrote: the YAML file and the
command line always win. `dagrl train --print-config algorithm.name=dapo` shows the result.
Each preset sets only what its paper prescribes and differs from the GRPO defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dagrl.config.loader import ConfigError, from_dict, load_user_dict, merge
from dagrl.config.schema import Config

# No KL loss term; a KL penalty folded into the reward instead (PPO/RLHF style).
_KL_IN_REWARD = {"kl_loss_coef": 0.0, "kl_in_reward": True}

PRESETS: dict[str, dict] = {
    # GRPO (Shao et al. 2024): the dataclass defaults.
    "grpo": {},
    # Dr.GRPO (Liu et al. 2025): no std normalisation, no length normalisation, no KL.
    "drgrpo": {"algorithm": {"norm_adv_by_std": False, "kl_loss_coef": 0.0,
                             "loss_agg_mode": "seq-mean-token-sum-norm"}},
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, overlong shaping,
    # no KL.
    "dapo": {"algorithm": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "kl_loss_coef": 0.0,
                           "loss_agg_mode": "token-mean"},
             "reward": {"overlong_buffer_len": 2, "overlong_penalty_factor": 0.5}},
    # GSPO (Zheng et al. 2025): sequence-level ratio with a narrow clip, sequence-mean loss.
    "gspo": {"algorithm": {"policy_loss": "gspo", "clip_ratio_low": 3e-4,
                           "clip_ratio_high": 4e-4, "kl_loss_coef": 0.0,
                           "loss_agg_mode": "seq-mean-token-mean"}},
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline, KL in the reward.
    "rloo": {"algorithm": {"adv_estimator": "rloo", **_KL_IN_REWARD}},
    # REINFORCE++ (Hu 2025): token returns whitened over the global batch, KL in the reward.
    "reinforce_pp": {"algorithm": {"adv_estimator": "reinforce_plus_plus", **_KL_IN_REWARD}},
    # ReMax (Li et al. 2023): the greedy response's reward is the baseline.
    "remax": {"algorithm": {"adv_estimator": "remax", **_KL_IN_REWARD}},
    # PPO (Schulman et al. 2017) with a critic and GAE; KL in the reward.
    "ppo": {"algorithm": {"adv_estimator": "gae", **_KL_IN_REWARD}, "rollout": {"n": 4}},
    # CPGD (Liu et al. 2025): clipped log-ratio objective with a policy-drift term.
    "cpgd": {"algorithm": {"adv_estimator": "cpgd", "policy_loss": "cpgd", "kl_loss_coef": 0.0}},
}


def load_run_config(path: str | Path | Mapping[str, Any] | None = None,
                    overrides: Sequence[str] = ()) -> Config:
    """defaults <- preset of algorithm.name <- YAML file <- overrides, strictly checked."""
    user = load_user_dict(path, overrides)
    algorithm = user.get("algorithm") or {}
    name = algorithm.get("name", "grpo") if isinstance(algorithm, dict) else "grpo"
    if name not in PRESETS:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; choose one of "
                          f"{', '.join(PRESETS)}")
    return from_dict(Config, merge(PRESETS[name], user))
