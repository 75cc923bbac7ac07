"""Advantage estimators, looked up by name from ``ADVANTAGE_ESTIMATORS``.

Every estimator takes one ``AdvantageInputs`` and returns ``(advantages [B, T], returns
[B, T])``, both zero outside ``response_mask``. It reads the fields its equation uses;
``AdvantageInputs.need`` names a missing one (and the graph node that computes it).

The sequence score is ``token_level_rewards.sum(-1)``. Group statistics are computed from the
local shard, so all samples of one prompt must sit on the same worker; batch-level statistics
(the whitening of REINFORCE++ and GAE) go through ``reducer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dagrl.algorithms.utils import Reducer, global_masked_whiten
from dagrl.registry import Registry


@dataclass
class AdvantageInputs:
    """Everything an estimator may read. Shapes for a shard of B samples, T response columns."""
    token_level_rewards: Tensor                # [B, T] the reward of each response token
    response_mask: Tensor                      # [B, T] 1 on response tokens
    group_index: Tensor | None = None          # [B] dense prompt-group id (samples of one
                                               #     prompt share it; they need not be adjacent)
    values: Tensor | None = None               # [B, T] critic values V(s_t)
    baseline_scores: Tensor | None = None      # [B] per-sample baseline (ReMax: greedy reward)
    reducer: Reducer | None = None             # sums over workers; None = one process
    gamma: float = 1.0                         # discount
    lam: float = 1.0                           # GAE λ
    norm_by_std: bool = True                   # GRPO/CPGD: divide by the group std
    eps: float = 1e-6                          # ... plus this

    # The graph node that puts each optional input into the batch.
    PRODUCERS = {"group_index": "rollout (the uid of each sample)", "values": "values",
                 "baseline_scores": "greedy_baseline"}

    def need(self, name: str) -> Tensor:
        """The optional input `name`; a KeyError naming the node to add when it is absent."""
        value = getattr(self, name)
        if value is None:
            raise KeyError(f"this advantage estimator needs {name!r}; add the node that "
                           f"computes it ({self.PRODUCERS[name]}) before the advantage node")
        return value


AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _check_inputs(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor) -> None:
    _check_token_inputs(token_level_rewards, response_mask)
    batch = token_level_rewards.shape[0]
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must be [B] = [{batch}], got {tuple(group_index.shape)}")
    if group_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_index must be an integer tensor, got dtype {group_index.dtype}")
    if batch and int(group_index.min()) < 0:
        raise ValueError(f"group_index must be non-negative, got min {int(group_index.min())}")


def _check_token_inputs(token_level_rewards: Tensor, response_mask: Tensor) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be [B, T], got shape {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )


def group_mean_std(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and unbiased group std of ``scores`` [B] -> ([B], [B]).

    μ_g = Σ_{i∈g} r_i / n_g,  σ_g = sqrt(Σ_{i∈g} (r_i − μ_g)² / (n_g − 1)).
    A group of one sample has no spread, so it gets μ = 0 and σ = 1: its advantage is then its
    raw score, which still pushes towards rewarded answers instead of silently dropping them.
    """
    index = group_index.long()
    num_groups = int(index.max()) + 1 if index.numel() else 0
    counts = torch.bincount(index, minlength=num_groups).to(scores.dtype)  # [G]
    sums = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, index, scores)
    # Ids absent from the batch have count 0; clamping keeps their (never gathered) entries finite.
    mean = sums / counts.clamp_min(1)  # [G]
    sq_dev = (scores - mean[index]) ** 2  # [B]
    sq_dev_sums = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, index, sq_dev)
    std = (sq_dev_sums / (counts - 1).clamp_min(1)).sqrt()  # [G]

    singleton = counts[index] < 2  # [B]
    sample_mean = torch.where(singleton, torch.zeros_like(scores), mean[index])
    sample_std = torch.where(singleton, torch.ones_like(scores), std[index])
    return sample_mean, sample_std


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def compute_grpo_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO group-relative advantage, broadcast over the response tokens.

    A_i = (r_i − mean(r_group)) / (std(r_group) + eps)   with the unbiased std (``x.norm_by_std``)
    A_i =  r_i − mean(r_group)                            (Dr.GRPO, ``x.norm_by_std=False``)

    r_i = Σ_t token_level_rewards[i, t]. A group of one sample uses mean 0 and std 1, so A_i = r_i
    (see ``group_mean_std``). Returns (advantages, returns), both [B, T] and equal.
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    group_index, norm_by_std, eps = x.need("group_index"), x.norm_by_std, x.eps
    _check_inputs(token_level_rewards, response_mask, group_index)
    scores = token_level_rewards.sum(-1)  # [B]
    mean, std = group_mean_std(scores, group_index)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # [B, T]
    return advantages, advantages


def _reward_to_go(token_level_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = Σ_{k≥t} γ^{k−t} r_k·m_k  [B, T], 0 outside the mask.

    One backward pass over T, vectorised over B: G_t = r_t·m_t + γ·G_{t+1}, G_T = 0.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    rewards = token_level_rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [B] = G_{t+1}
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * mask


def _check_gamma_lam(gamma: float, lam: float = 1.0) -> None:
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def compute_rloo_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """RLOO leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics").

    A_i = r_i − (Σ_{j∈g, j≠i} r_j) / (n_g − 1)

    r_i = Σ_t token_level_rewards[i, t]. Each sample's baseline is the mean score of the *other*
    samples of its prompt, so it is independent of the sample and the estimate stays unbiased;
    the advantages of a group sum to zero. A group of one sample has no other sample to form a
    baseline, so it gets A_i = r_i. Returns (advantages, returns), both [B, T] and equal.
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    group_index = x.need("group_index")
    _check_inputs(token_level_rewards, response_mask, group_index)
    scores = token_level_rewards.sum(-1)  # [B]
    index = group_index.long()
    num_groups = int(index.max()) + 1 if index.numel() else 0
    counts = torch.bincount(index, minlength=num_groups).to(scores.dtype)[index]  # [B] = n_g
    sums = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, index, scores)[index]  # [B]
    # Singletons divide 0 by a count clamped to 1 and get baseline 0, i.e. A_i = r_i.
    baseline = (sums - scores) / (counts - 1).clamp_min(1)
    adv = scores - baseline
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # [B, T]
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm ..."): whitened returns.

    G_t = Σ_{k≥t} γ^{k−t} r_k                   (r may carry a per-token −β·KL penalty)
    A_t = (G_t − μ_G) / sqrt(σ²_G + 1e-8)       μ, σ² over every response token of the
                                                global batch (``x.reducer``), not per prompt
    Returns (A, G).
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    reducer, gamma = x.reducer, x.gamma
    _check_token_inputs(token_level_rewards, response_mask)
    _check_gamma_lam(gamma)
    returns = _reward_to_go(token_level_rewards, response_mask, gamma)  # [B, T]
    advantages = global_masked_whiten(returns, response_mask, reducer)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): group-mean baseline, then global whitening.

    s_i   = Σ_t r_{i,t}                     (a per-token KL penalty in r enters through this sum)
    A'_it = (s_i − mean_{j∈g} s_j) · m_it   the same value at every response token
    A_it  = (A'_it − μ) / sqrt(σ² + 1e-8)   μ, σ² over every response token of the global batch

    This is verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``: the group mean
    removes the prompt's difficulty without GRPO's per-group std, and the batch-level whitening
    restores a unit scale. A group of one sample uses mean 0 (see ``group_mean_std``).
    Returns (advantages, returns), both [B, T] and equal.
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    group_index, reducer = x.need("group_index"), x.reducer
    _check_inputs(token_level_rewards, response_mask, group_index)
    scores = token_level_rewards.sum(-1)  # [B]
    mean, _ = group_mean_std(scores, group_index)
    centred = (scores - mean).unsqueeze(-1) * response_mask.to(scores.dtype)  # [B, T]
    advantages = global_masked_whiten(centred, response_mask, reducer)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("remax")
@torch.no_grad()
def compute_remax_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient RL Method for LLMs").

    G_t = Σ_{k≥t} r_k,   A_t = G_t − b_i

    b_i = ``x.baseline_scores[i]``, the reward of the greedy response to sample i's prompt: a
    baseline that depends only on the prompt, so the gradient stays unbiased. No normalisation.
    Returns (A, G).
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    baseline_scores = x.need("baseline_scores")
    _check_token_inputs(token_level_rewards, response_mask)
    if baseline_scores.shape != (token_level_rewards.shape[0],):
        raise ValueError(
            f"baseline_scores must be [B] = [{token_level_rewards.shape[0]}], got "
            f"{tuple(baseline_scores.shape)}"
        )
    returns = _reward_to_go(token_level_rewards, response_mask, gamma=1.0)  # [B, T]
    mask = response_mask.to(returns.dtype)
    advantages = (returns - baseline_scores.to(returns.dtype).unsqueeze(-1)) * mask
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def compute_gae_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16), whitened.

    δ_t = r_t + γ·V_{t+1} − V_t             V after the last response token = 0
    Â_t = Σ_{l≥0} (γλ)^l δ_{t+l}  =  δ_t + γλ·Â_{t+1}
    R_t = Â_t + V_t                          (the value target, not whitened)
    A_t = (Â_t − μ) / sqrt(σ² + 1e-8)        μ, σ² over every response token of the global batch

    ``x.response_mask`` must be right-padded (each row a prefix of ones): masking V to 0 on the
    padding then makes V_{t+1} = 0 after the last token and δ = Â = 0 on the padding.
    Returns (A, R).
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    values, reducer, gamma, lam = x.need("values"), x.reducer, x.gamma, x.lam
    _check_token_inputs(token_level_rewards, response_mask)
    if values.shape != token_level_rewards.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    _check_gamma_lam(gamma, lam)
    mask = response_mask.to(token_level_rewards.dtype)
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("response_mask must be right-padded: a 1 follows a 0 in some row")
    v = values.to(mask.dtype) * mask  # [B, T]
    r = token_level_rewards * mask
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])  # [B] = V_{t+1}
    next_adv = torch.zeros_like(r[:, 0])  # [B] = Â_{t+1}
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        next_adv = delta + gamma * lam * next_adv
        adv[:, t] = next_adv
        next_value = v[:, t]
    returns = (adv + v) * mask
    advantages = global_masked_whiten(adv, mask, reducer)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("cpgd")
@torch.no_grad()
def compute_cpgd_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """CPGD weighted advantage (Liu et al. 2025, "CPGD: Toward Stable Rule-based RL for LMs").

    A_ω(x, y_k) = ω(x) · (R(x, y_k) − mean_{k'} R(x, y_k'))         (Sec. 4.3, under eq. 2)

    ω(x) = 1 / (std_k R(x, y_k) + eps)   "STD weight", ``norm_by_std=True`` (the default of
                                         the paper's main results and of siiRL's
                                         ``weight_factor_in_cpgd="STD_weight"``)
    ω(x) = 1                             "equal weight", ``norm_by_std=False``

    The std is the unbiased group std and a group of one sample uses mean 0, std 1 (see
    ``group_mean_std``), as in siiRL's ``compute_cpgd_outcome_advantage``. The paper's third
    option, the "clip-filter-like" weight min(c_ω, #prompts / #prompts with std ≠ 0), needs a
    batch-level count and a constant no config passes, so it is not offered here.
    Returns (advantages, returns), both [B, T] and equal.
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    group_index, norm_by_std, eps = x.need("group_index"), x.norm_by_std, x.eps
    _check_inputs(token_level_rewards, response_mask, group_index)
    scores = token_level_rewards.sum(-1)  # [B]
    mean, std = group_mean_std(scores, group_index)
    weight = 1.0 / (std + eps) if norm_by_std else torch.ones_like(std)  # [B] = ω(x_i)
    adv = weight * (scores - mean)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # [B, T]
    return advantages, advantages
