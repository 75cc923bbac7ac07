"""Estimators built on returns along the tokens: REINFORCE++ (and its group-baseline variant),
ReMax and GAE. Masked positions inside a response (multi-turn observation tokens) get no reward
and take no discount or TD step, as in verl's ``core_algos``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dagrl.algorithms.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    broadcast,
    check_gamma_lam,
    check_group_inputs,
    check_token_inputs,
    group_mean_std,
    reward_to_go,
)
from dagrl.algorithms.utils import global_masked_whiten


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm ..."): whitened returns.

    G_t = r_t + γ·G_{t'}                        t' the next response token (``reward_to_go``;
                                                r may carry a per-token −β·KL penalty)
    A_t = (G_t − μ_G) / sqrt(σ²_G + 1e-8)       μ, σ² over every response token of the
                                                global batch (``x.reducer``), not per prompt
    Returns (A, G).
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    check_token_inputs(token_level_rewards, response_mask)
    check_gamma_lam(x.gamma)
    returns = reward_to_go(token_level_rewards, response_mask, x.gamma)  # [B, T]
    advantages = global_masked_whiten(returns, response_mask, x.reducer)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): group-mean baseline, then global whitening.

    s_i   = Σ_t r_{i,t}                     (a per-token KL penalty in r enters through this sum)
    A'_it = (s_i − mean_{j∈g} s_j) · m_it   the same value at every response token
    A_it  = (A'_it − μ) / sqrt(σ² + 1e-8)   μ, σ² over every response token of the global batch

    The group mean removes the prompt's difficulty without GRPO's per-group std, and the
    batch-level whitening restores a unit scale. A group of one sample uses mean 0 (see
    ``group_mean_std``). Returns (advantages, returns), both [B, T] and equal.
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    group_index = x.need("group_index")
    check_group_inputs(token_level_rewards, response_mask, group_index)
    scores = token_level_rewards.sum(-1)  # [B]
    mean, _ = group_mean_std(scores, group_index)
    centred = broadcast(scores - mean, response_mask)  # [B, T]
    advantages = global_masked_whiten(centred, response_mask, x.reducer)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("remax")
@torch.no_grad()
def compute_remax_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient RL Method for LLMs").

    G_t = Σ_{k≥t} r_k·m_k,   A_t = G_t − b_i

    b_i = ``x.baseline_scores[i]``, the reward of the greedy response to sample i's prompt: a
    baseline that depends only on the prompt, so the gradient stays unbiased. No normalisation.
    Returns (A, G).
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    baseline_scores = x.need("baseline_scores")
    check_token_inputs(token_level_rewards, response_mask)
    if baseline_scores.shape != (token_level_rewards.shape[0],):
        raise ValueError(
            f"baseline_scores must be [B] = [{token_level_rewards.shape[0]}], got "
            f"{tuple(baseline_scores.shape)}"
        )
    returns = reward_to_go(token_level_rewards, response_mask, gamma=1.0)  # [B, T]
    advantages = returns - broadcast(baseline_scores.to(returns.dtype), response_mask)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def compute_gae_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16), whitened.

    δ_t = r_t + γ·V_{t'} − V_t               t' the next response token; V after the last = 0
    Â_t = δ_t + γλ·Â_{t'}                     (= Σ_l (γλ)^l δ over the following response tokens)
    R_t = Â_t + V_t                          (the value target, not whitened)
    A_t = (Â_t − μ) / sqrt(σ² + 1e-8)        μ, σ² over every response token of the global batch

    The response mask may have gaps: a masked position (a tool or user turn inside a multi-turn
    response) is skipped, its V, r and δ unused and V_{t'} / Â_{t'} carried through it to the
    response token before it, as verl's ``compute_gae_advantage_return`` does.
    Returns (A, R).
    """
    token_level_rewards, response_mask = x.token_level_rewards, x.response_mask
    values = x.need("values")
    check_token_inputs(token_level_rewards, response_mask)
    if values.shape != token_level_rewards.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    check_gamma_lam(x.gamma, x.lam)
    gamma, lam = x.gamma, x.lam
    mask = response_mask.to(token_level_rewards.dtype)
    v = values.to(mask.dtype)
    r = token_level_rewards
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])  # [B] = V_{t'}
    next_adv = torch.zeros_like(r[:, 0])  # [B] = Â_{t'}
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        stepped = delta + gamma * lam * next_adv
        valid = mask[:, t] > 0
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, stepped, next_adv)
        adv[:, t] = next_adv
    returns = (adv + v) * mask
    advantages = global_masked_whiten(adv, mask, x.reducer)
    return advantages, returns
