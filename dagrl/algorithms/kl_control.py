"""KL-in-reward: the penalty coefficient β and its application to the token rewards."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dagrl.algorithms.kl import kl_penalty
from dagrl.algorithms.utils import masked_mean


class FixedKLController:
    """A constant β; ``update`` is a no-op kept so both controllers share one interface."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional β control towards a target KL (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences"):

        e_t     = clip(KL_t / KL_target − 1, −0.2, 0.2)
        β_{t+1} = β_t · (1 + K_β · e_t)         with K_β = n_steps / horizon

    ``n_steps`` is the number of samples (or steps) the measured KL covers; ``horizon`` sets how
    many of them it takes to correct a given error. Clipping e bounds each multiplicative step,
    so one noisy KL reading cannot move β by more than a factor 1 ± 0.2·n_steps/horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def apply_kl_penalty(
    token_level_scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    coef: float,
    kind: str = "k1",
) -> tuple[Tensor, Tensor]:
    """KL-in-reward (Ziegler et al. 2019; Ouyang et al. 2022): r_t = score_t − β · KL_t.

    KL_t is the per-token estimate of KL(π ‖ π_ref) of the estimator ``kind`` (a name in
    ``KL_ESTIMATORS``) from the rollout-time log-probs; β = ``coef``. All inputs are [B, T].
    Returns (token_level_rewards, kl), both [B, T] and 0 outside the mask.
    """
    if coef < 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    if token_level_scores.shape != logprobs.shape or response_mask.shape != logprobs.shape:
        raise ValueError(
            f"apply_kl_penalty: token_level_scores {tuple(token_level_scores.shape)}, logprobs "
            f"{tuple(logprobs.shape)} and response_mask {tuple(response_mask.shape)} must match"
        )
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_penalty(logprobs, ref_logprobs, kind) * mask  # [B, T]
    rewards = (token_level_scores - coef * kl) * mask
    return rewards, kl


def controller_kl_sums(kl: Tensor, response_mask: Tensor) -> Tensor:
    """The KL the adaptive controller steps on, as local sums to add over the workers:
    [2] = (Σ_i KL̄_i, B), KL̄_i = Σ_t KL_it·m_it / Σ_t m_it (0 for an empty row).

    The controller's KL is Σ_i KL̄_i / B, the batch mean of per-sequence means (verl's
    ``apply_kl_penalty``), not the token mean Σ KL·m / Σ m: every sequence counts once, however
    long, so a few long responses with a large KL cannot move β for the whole batch.
    """
    per_sequence = masked_mean(kl, response_mask, dim=-1)  # [B] = KL̄_i
    return torch.stack([per_sequence.sum().to(torch.float64),
                        torch.tensor(float(kl.shape[0]), dtype=torch.float64, device=kl.device)])
