"""What every advantage estimator shares: its inputs, the registry, input checks and the group
and return helpers.

Every estimator takes one ``AdvantageInputs`` and returns ``(advantages [B, T], returns
[B, T])``, both zero outside ``response_mask``. It reads the fields its equation uses;
``AdvantageInputs.need`` names a missing one (and the graph node that computes it).

The sequence score is ``token_level_rewards.sum(-1)``. Group statistics are computed from the
local shard, so all samples of one prompt must sit on the same worker; batch-level statistics
(whitening, GPG's nonzero count) go through ``reducer``.

The response mask may have gaps (multi-turn: tool or user tokens inside the response are 0):
estimators that walk along the tokens skip the masked positions, as verl's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dagrl.algorithms.utils import Reducer
from dagrl.registry import Registry


@dataclass
class AdvantageInputs:
    """Everything an estimator may read. Shapes for a shard of B samples, T response columns."""
    token_level_rewards: Tensor                # [B, T] the reward of each response token
    response_mask: Tensor                      # [B, T] 1 on response tokens (gaps allowed)
    group_index: Tensor | None = None          # [B] dense prompt-group id (samples of one
                                               #     prompt share it; they need not be adjacent)
    values: Tensor | None = None               # [B, T] critic values V(s_t)
    baseline_scores: Tensor | None = None      # [B] per-sample baseline (ReMax: greedy reward)
    old_logprobs: Tensor | None = None         # [B, T] log π_old(y_t) (optimal token baseline)
    sum_pi_squared: Tensor | None = None       # [B, T] Σ_v π_old(v | s_t)² (same)
    rollout_is_weights: Tensor | None = None   # [B, T] rollout importance weights, if any
    reward_components: dict[str, Tensor] | None = None  # name -> [B] (GDPO's reward terms)
    reward_weights: Sequence[float] | None = None       # GDPO's weight per component
    reducer: Reducer | None = None             # sums over workers; None = one process
    gamma: float = 1.0                         # discount
    lam: float = 1.0                           # GAE λ
    norm_by_std: bool = True                   # GRPO/CPGD/pass@k/GDPO: divide by the group std
    eps: float = 1e-6                          # ... plus this

    # The graph node that puts each optional input into the batch.
    PRODUCERS = {"group_index": "rollout (the uid of each sample)", "values": "values",
                 "baseline_scores": "greedy_baseline", "old_logprobs": "old_logprob",
                 "sum_pi_squared": "old_logprob (it computes sum_pi_squared when the estimator "
                                   "needs it)",
                 "reward_components": "reward (with algorithm.gdpo_reward_keys)"}

    def need(self, name: str) -> Tensor:
        """The optional input `name`; a KeyError naming the node to add when it is absent."""
        value = getattr(self, name)
        if value is None:
            raise KeyError(f"this advantage estimator needs {name!r}; add the node that "
                           f"computes it ({self.PRODUCERS[name]}) before the advantage node")
        return value

    def reduce(self, t: Tensor) -> Tensor:
        """Σ over the workers of ``t`` (the identity for one process)."""
        return self.reducer(t) if self.reducer is not None else t


AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def check_token_inputs(token_level_rewards: Tensor, response_mask: Tensor) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be [B, T], got shape {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )


def check_group_inputs(token_level_rewards: Tensor, response_mask: Tensor,
                       group_index: Tensor) -> None:
    check_token_inputs(token_level_rewards, response_mask)
    batch = token_level_rewards.shape[0]
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must be [B] = [{batch}], got {tuple(group_index.shape)}")
    if group_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_index must be an integer tensor, got dtype {group_index.dtype}")
    if batch and int(group_index.min()) < 0:
        raise ValueError(f"group_index must be non-negative, got min {int(group_index.min())}")


def check_gamma_lam(gamma: float, lam: float = 1.0) -> None:
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")


def group_sums(values: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample (n_g, Σ_{j∈g} x_j) of ``values`` [B] -> ([B], [B])."""
    index = group_index.long()
    num_groups = int(index.max()) + 1 if index.numel() else 0
    counts = torch.bincount(index, minlength=num_groups).to(values.dtype)  # [G]
    sums = values.new_zeros(num_groups).index_add_(0, index, values)  # [G]
    return counts[index], sums[index]


def group_mean_std(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and unbiased group std of ``scores`` [B] -> ([B], [B]).

    μ_g = Σ_{i∈g} r_i / n_g,  σ_g = sqrt(Σ_{i∈g} (r_i − μ_g)² / (n_g − 1)).
    A group of one sample has no spread, so it gets μ = 0 and σ = 1: its advantage is then its
    raw score, which still pushes towards rewarded answers instead of silently dropping them
    (verl's convention, in its loop and its vectorized GRPO alike).
    """
    counts, sums = group_sums(scores, group_index)  # [B], [B]
    # Counts are >= 1 for every sample's own group.
    mean = sums / counts
    _, sq_dev_sums = group_sums((scores - mean) ** 2, group_index)
    std = (sq_dev_sums / (counts - 1).clamp_min(1)).sqrt()

    singleton = counts < 2  # [B]
    sample_mean = torch.where(singleton, torch.zeros_like(scores), mean)
    sample_std = torch.where(singleton, torch.ones_like(scores), std)
    return sample_mean, sample_std


def broadcast(per_sample: Tensor, response_mask: Tensor) -> Tensor:
    """A per-sample value [B] on every response token: [B, T], 0 outside the mask."""
    return per_sample.unsqueeze(-1) * response_mask.to(per_sample.dtype)


def reward_to_go(token_level_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ·G_{t'} at response tokens, t' the next response token; [B, T], 0 elsewhere.

    Masked positions (padding, and the observation tokens inside a multi-turn response) carry no
    reward and take no discount step: G passes through them unchanged, so with gaps
    G_t = Σ_k γ^(number of response tokens strictly between t and k) · r_k over the response
    tokens k ≥ t. One backward pass over T, vectorised over B.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])  # [B] = G at the next response token
    for t in reversed(range(token_level_rewards.shape[1])):
        stepped = token_level_rewards[:, t] + gamma * running
        running = torch.where(mask[:, t] > 0, stepped, running)
        returns[:, t] = stepped
    return returns * mask
