"""The optimal token baseline (OTB; Li et al. 2026, "The Optimal Token Baseline: Variance
Reduction for Long-Horizon LLM-RL", arXiv 2602.07078) and its tool-integrated (multi-turn)
variant: a baseline per token position and prompt group, weighted by each trajectory's
accumulated gradient variance.

For a trajectory i of prompt group g, with the old policy π_old:

    G_i,t = Σ_{k≥t} r_i,k·m_i,k                         reward-to-go (γ = 1)
    w_i,t = 1 − 2·π_old(y_t) + Σ_v π_old(v | s_t)²      ‖∇ log π(y_t)‖² proxy of the logits:
                                                        ‖e_y − π‖² = 1 − 2π_y + Σπ²
    w_i,t ← w_i,t · ρ_i,t²                              with rollout IS weights ρ (if any)
    W_i,t = Σ_{j≤t} w_i,j·m_i,j                         cumulative path variance
    B_g,t = Σ_{i∈g} G_i,t·W_i,t·m_i,t / (Σ_{i∈g} W_i,t·m_i,t + ε)
    A_i,t = (G_i,t − B_g,t)·m_i,t

B_t = E[G_t·W_t]/E[W_t] minimises the variance of the gradient estimate (G − B)·∇log π when the
score-function norm is approximated by W (the baseline of Greensmith et al. 2004, per step).
verl's ``compute_optimal_token_baseline_advantage`` and its TIR twin are the reference: a group
of one trajectory gets B = 0, and with ``handle_zero_tail`` the positions of the group's unique
longest trajectory past the second-longest one get B = 0 (no other trajectory informs them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dagrl.algorithms.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    check_group_inputs,
)

OTB_EPS = 1e-8  # ε of B_g,t's denominator (verl's default)


def _returns_and_path_variance(x: AdvantageInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(G [B, T], W [B, T], group_index [B]) from the inputs, checked."""
    group_index = x.need("group_index")
    old_logprobs, sum_pi_squared = x.need("old_logprobs"), x.need("sum_pi_squared")
    rewards, mask = x.token_level_rewards, x.response_mask.to(x.token_level_rewards.dtype)
    check_group_inputs(rewards, x.response_mask, group_index)
    if old_logprobs.shape != rewards.shape or sum_pi_squared.shape != rewards.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)} and sum_pi_squared "
                         f"{tuple(sum_pi_squared.shape)} must be [B, T] = {tuple(rewards.shape)}")
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [B, T] = G (γ = 1)
    w = 1.0 - 2.0 * torch.exp(old_logprobs) + sum_pi_squared  # [B, T] = ‖∇ log π(y_t)‖² proxy
    if x.rollout_is_weights is not None:
        w = w * x.rollout_is_weights ** 2
    path_variance = (w * mask).cumsum(-1)  # [B, T] = W
    return returns, path_variance, group_index


def _zero_tail(baselines: Tensor, members: Tensor, lengths: Tensor) -> None:
    """B = 0 from the second-longest length on, in the group's longest row when it is unique.

    ``baselines`` [B, T'] is written in place; ``members`` [n] the group's rows; ``lengths`` [n]
    their response lengths.
    """
    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_longest = (lengths == longest).nonzero(as_tuple=True)[0]
    if at_longest.numel() == 1 and longest > second:
        baselines[members[at_longest[0]], second:] = 0.0


@ADVANTAGE_ESTIMATORS.register("optimal_token_baseline")
@torch.no_grad()
def compute_optimal_token_baseline_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Optimal token baseline (Li et al. 2026, arXiv 2602.07078): A_i,t = (G_i,t − B_g,t)·m_i,t,
    one baseline B per group and *column* t (see the module docstring for G, W and B).

    The columns are the padded response positions, so trajectories are aligned by column; for a
    response mask with gaps (multi-turn) use ``tir_optimal_token_baseline``, which aligns them by
    the index among their own response tokens. Zero-tail handling is on.
    Returns (A, G).
    """
    returns, path_variance, group_index = _returns_and_path_variance(x)
    mask = x.response_mask.to(returns.dtype)
    baselines = torch.zeros_like(returns)
    lengths = mask.sum(-1)  # [B]
    for g in torch.unique(group_index):
        members = (group_index == g).nonzero(as_tuple=True)[0]  # [n_g]
        if members.numel() == 1:
            continue  # no baseline: A = G
        g_ret, g_w, g_mask = returns[members], path_variance[members], mask[members]
        numerator = (g_ret * g_w * g_mask).sum(0)  # [T] = Σ_i G·W·m
        denominator = (g_w * g_mask).sum(0) + OTB_EPS  # [T] = Σ_i W·m + ε
        baselines[members] = (numerator / denominator).expand(members.numel(), -1)
        _zero_tail(baselines, members, lengths[members])
    advantages = (returns - baselines) * mask
    return advantages, returns * mask


@ADVANTAGE_ESTIMATORS.register("tir_optimal_token_baseline")
@torch.no_grad()
def compute_tir_optimal_token_baseline_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Optimal token baseline for tool-integrated (multi-turn) responses (Li et al. 2026): one
    baseline per group and response-token index, the observation tokens of the gaps removed.

    As ``optimal_token_baseline``, but each trajectory's response tokens are first packed left,
    so B_g,k is taken over the k-th *response token* of each trajectory rather than the k-th
    column:

    B_g,k = Σ_{i∈g} G_i,(k)·W_i,(k) / (Σ_{i∈g} W_i,(k) + ε)     (k) = i's k-th response token

    A trajectory shorter than k adds 0 to both sums. Trajectories with no response token are
    left out of their group (A = 0). Zero-tail handling is on. Returns (A, G).
    """
    returns, path_variance, group_index = _returns_and_path_variance(x)
    mask = x.response_mask.bool()
    lengths = mask.sum(-1)  # [B]
    width = int(lengths.max()) if lengths.numel() else 0
    # Pack each row's response tokens left: slot k holds its k-th response token.
    slot = mask.long().cumsum(-1) - 1  # [B, T] = k at each response token
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1).expand_as(mask)
    packed_w = returns.new_zeros(mask.shape[0], width)
    packed_ret = returns.new_zeros(mask.shape[0], width)
    packed_w[rows[mask], slot[mask]] = path_variance[mask]
    packed_ret[rows[mask], slot[mask]] = returns[mask]

    baselines = torch.zeros_like(packed_ret)  # [B, width]
    for g in torch.unique(group_index):
        members = ((group_index == g) & (lengths > 0)).nonzero(as_tuple=True)[0]
        if members.numel() <= 1:
            continue  # no baseline: A = G
        g_w, g_ret = packed_w[members], packed_ret[members]
        b_star = (g_ret * g_w).sum(0) / (g_w.sum(0) + OTB_EPS)  # [width]
        baselines[members] = b_star.to(baselines.dtype).expand(members.numel(), -1)
        _zero_tail(baselines, members, lengths[members])

    advantages = torch.zeros_like(returns)
    advantages[mask] = (packed_ret - baselines)[rows[mask], slot[mask]]
    return advantages, returns * mask.to(returns.dtype)
