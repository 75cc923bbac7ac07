"""Outcome estimators with a per-prompt-group baseline: one scalar per sample, broadcast over
its response tokens (so advantages and returns are equal).

r_i = Σ_t token_level_rewards[i, t] is sample i's score; g is its prompt group (``group_index``),
n_g the group's size. Names and singleton conventions are verl's (``core_algos``).

verl keeps two twins whose edge cases differ, and both are registered under their verl names:
``grpo`` / ``grpo_vectorized`` agree everywhere (a singleton group gets μ = 0, σ = 1 in both);
``rloo`` / ``rloo_vectorized`` disagree on a singleton group: the loop gives A = r (no baseline),
the vectorized version A = 0 (the sample is dropped).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dagrl.algorithms.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    broadcast,
    check_group_inputs,
    group_mean_std,
    group_sums,
)
from dagrl.algorithms.utils import global_masked_whiten


def _scores_and_groups(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    group_index = x.need("group_index")
    check_group_inputs(x.token_level_rewards, x.response_mask, group_index)
    return x.token_level_rewards.sum(-1), group_index  # [B], [B]


def _grpo_scalar(scores: Tensor, group_index: Tensor, norm_by_std: bool, eps: float) -> Tensor:
    """(r_i − μ_g) / (σ_g + ε), or r_i − μ_g without the std: [B]."""
    mean, std = group_mean_std(scores, group_index)
    adv = scores - mean
    return adv / (std + eps) if norm_by_std else adv


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def compute_grpo_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, eq. 3's outcome form).

    A_i = (r_i − mean(r_group)) / (std(r_group) + eps)   with the unbiased std (``x.norm_by_std``)
    A_i =  r_i − mean(r_group)                            (Dr.GRPO, ``x.norm_by_std=False``)

    A group of one sample uses mean 0 and std 1, so A_i = r_i (see ``group_mean_std``).
    """
    scores, group_index = _scores_and_groups(x)
    advantages = broadcast(_grpo_scalar(scores, group_index, x.norm_by_std, x.eps),
                           x.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("grpo_vectorized")
@torch.no_grad()
def compute_grpo_vectorized_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO, verl's vectorized twin: the same A_i = (r_i − μ_g)/(σ_g + ε) as ``grpo``.

    verl computes its group statistics in float32 with a scatter instead of a Python loop; the
    definitions (unbiased σ, singleton μ = 0 and σ = 1) are the loop's, so dagrl computes both
    names with one function and returns identical values.
    """
    return compute_grpo_advantages(x)


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def compute_rloo_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """RLOO leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics", eq. 6).

    A_i = r_i − (Σ_{j∈g, j≠i} r_j) / (n_g − 1)     = (n_g·r_i − Σ_{j∈g} r_j) / (n_g − 1)

    Each sample's baseline is the mean score of the *other* samples of its prompt, so it is
    independent of the sample and the estimate stays unbiased; the advantages of a group sum to
    zero. A group of one sample has no other sample to form a baseline, so it gets A_i = r_i
    (verl's loop ``rloo``; see ``rloo_vectorized`` for the other choice).
    """
    scores, group_index = _scores_and_groups(x)
    counts, sums = group_sums(scores, group_index)  # [B] = n_g, Σ_{j∈g} r_j
    # Singletons divide 0 by a count clamped to 1 and get baseline 0, i.e. A_i = r_i.
    baseline = (sums - scores) / (counts - 1).clamp_min(1)
    advantages = broadcast(scores - baseline, x.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("rloo_vectorized")
@torch.no_grad()
def compute_rloo_vectorized_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """RLOO, verl's vectorized twin: A_i = (n_g·r_i − Σ_{j∈g} r_j) / (n_g − 1) · [n_g > 1].

    Equal to ``rloo`` for groups of two or more; a singleton group gets A_i = 0 here (verl
    multiplies by ``c > 1``) where the loop gives A_i = r_i.
    """
    scores, group_index = _scores_and_groups(x)
    counts, sums = group_sums(scores, group_index)
    adv = (counts * scores - sums) / (counts - 1).clamp_min(1) * (counts > 1).to(scores.dtype)
    advantages = broadcast(adv, x.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("opo")
@torch.no_grad()
def compute_opo_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """OPO, the optimal baseline for on-policy RL (Hao et al. 2025, "On-Policy RL with Optimal
    Reward Baseline", arXiv 2505.23585): a length-weighted group mean.

    b_g = Σ_{j∈g} |y_j|·r_j / Σ_{j∈g} |y_j|,    A_i = r_i − b_g

    |y_j| = Σ_t m_jt, the response's token count: under a sequence-level reward the variance-
    optimal baseline weighs each sample by its gradient norm, which grows with its length.
    A group of one sample gets b = 0, A_i = r_i.
    """
    scores, group_index = _scores_and_groups(x)
    lengths = x.response_mask.to(scores.dtype).sum(-1)  # [B] = |y_i|
    counts, weighted = group_sums(lengths * scores, group_index)
    _, total_length = group_sums(lengths, group_index)
    # A group whose responses are all empty has Σ|y| = 0; verl divides 0 by 0 there (NaN);
    # the clamp gives b = 0 instead (the advantage is 0 on an empty mask either way).
    baseline = torch.where(counts > 1, weighted / total_length.clamp_min(1.0),
                           torch.zeros_like(scores))
    advantages = broadcast(scores - baseline, x.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("gpg")
@torch.no_grad()
def compute_gpg_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GPG, Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning", arXiv 2504.02546):

    A_i = α · (r_i − mean(r_group)) / F_norm,     α = B / max(#{j : r_j ≠ 0}, 1),  F_norm = 1

    α rescales the batch's gradient by its share of samples with a nonzero reward, undoing the
    dilution by all-zero samples (the paper's "accurate gradient estimation"); B and the count
    run over the global batch (``x.reducer``). A group of one sample uses mean 0. No std.
    """
    scores, group_index = _scores_and_groups(x)
    counts = x.reduce(torch.stack([torch.tensor(float(scores.numel()), dtype=torch.float64,
                                                device=scores.device),
                                   torch.count_nonzero(scores).to(torch.float64)]))
    alpha = counts[0] / counts[1].clamp(min=1)  # α = B / m over every worker's samples
    f_norm = 1.0
    mean, _ = group_mean_std(scores, group_index)
    adv = (alpha.to(scores.dtype) * (scores - mean)) / f_norm
    advantages = broadcast(adv, x.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Pass@k advantage (arXiv 2503.19595, as verl implements it): only the best sample of a
    group is credited, by its margin over the runner-up.

    A_i = (r_max − r_second) / (std(r_group) + eps)   for i = argmax_{j∈g} r_j
    A_i = 0                                            for every other sample
    (without ``/ (std + eps)`` when ``x.norm_by_std`` is False.)

    Ties at the top give the first of them (in batch order) the margin 0, as ``torch.topk``
    does in verl. Every group needs at least two samples.
    """
    scores, group_index = _scores_and_groups(x)
    advantages = torch.zeros_like(scores)
    for g in torch.unique(group_index):
        members = (group_index == g).nonzero(as_tuple=True)[0]  # [n_g] batch positions
        rewards = scores[members]
        if rewards.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; group {int(g)} "
                             f"has {rewards.numel()}")
        top, top_idx = torch.topk(rewards, 2)
        margin = top[0] - top[1]
        if x.norm_by_std:
            margin = margin / (torch.std(rewards) + x.eps)
        advantages[members[top_idx[0]]] = margin
    advantages = broadcast(advantages, x.response_mask)
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("gdpo")
@torch.no_grad()
def compute_gdpo_advantages(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GDPO, Group reward-Decoupled normalization Policy Optimization (arXiv 2601.05242): each
    reward component is normalised within its group before they are added, then the sum is
    whitened over the batch.

    A_k,i = (r_k,i − mean_g(r_k)) / (std_g(r_k) + eps)     per component k (GRPO's A)
    S_i   = Σ_k w_k · A_k,i
    A_it  = (S_i − μ) / sqrt(σ² + 1e-8)                    μ, σ² over every response token of
                                                           the global batch (``x.reducer``)

    The components are ``x.reward_components`` (the scorer's keys named by
    ``algorithm.gdpo_reward_keys``), weighted by ``x.reward_weights`` (default 1 each). Without
    components the total score r_i is the only one (verl's fallback), i.e. whitened GRPO.
    A component that dominates the sum in scale can no longer drown the others.
    """
    scores, group_index = _scores_and_groups(x)
    components = list((x.reward_components or {"score": scores}).values())
    weights = x.reward_weights if x.reward_weights is not None else [1.0] * len(components)
    if len(weights) != len(components):
        raise ValueError(f"gdpo: {len(weights)} reward weights for {len(components)} reward "
                         "components; give one weight per component")
    summed = torch.zeros_like(scores)
    for w, component in zip(weights, components, strict=True):
        if component.shape != scores.shape:
            raise ValueError(f"gdpo: a reward component must be [B] = [{scores.numel()}], got "
                             f"{tuple(component.shape)}")
        summed = summed + w * _grpo_scalar(component.to(scores.dtype), group_index,
                                           x.norm_by_std, x.eps)
    advantages = global_masked_whiten(broadcast(summed, x.response_mask), x.response_mask,
                                      x.reducer)
    return advantages, advantages


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
    batch-level count and a constant no config passes, so it is not offered here. (Not a verl
    estimator; siiRL's.)
    """
    scores, group_index = _scores_and_groups(x)
    mean, std = group_mean_std(scores, group_index)
    weight = 1.0 / (std + x.eps) if x.norm_by_std else torch.ones_like(std)  # [B] = ω(x_i)
    advantages = broadcast(weight * (scores - mean), x.response_mask)
    return advantages, advantages
