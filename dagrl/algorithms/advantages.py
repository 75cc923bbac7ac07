"""Outcome-reward advantage estimators, looked up by name from ``ADVANTAGE_ESTIMATORS``.

Every estimator has the signature::

    fn(token_level_rewards [B, T], response_mask [B, T], group_index [B], **options)
        -> (advantages [B, T], returns [B, T])

The sequence score is ``token_level_rewards.sum(-1)``. ``group_index`` holds each sample's prompt
group as a dense integer id (samples of one prompt share an id; a group's samples need not be
adjacent). Both outputs are zero outside ``response_mask``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dagrl.registry import Registry

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _check_inputs(token_level_rewards: Tensor, response_mask: Tensor, group_index: Tensor) -> None:
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be [B, T], got shape {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    batch = token_level_rewards.shape[0]
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must be [B] = [{batch}], got {tuple(group_index.shape)}")
    if group_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_index must be an integer tensor, got dtype {group_index.dtype}")
    if batch and int(group_index.min()) < 0:
        raise ValueError(f"group_index must be non-negative, got min {int(group_index.min())}")


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
def compute_grpo_advantages(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO group-relative advantage, broadcast over the response tokens.

    A_i = (r_i − mean(r_group)) / (std(r_group) + eps)   with the unbiased std (``norm_by_std``)
    A_i =  r_i − mean(r_group)                            (Dr.GRPO, ``norm_by_std=False``)

    r_i = Σ_t token_level_rewards[i, t]. A group of one sample uses mean 0 and std 1, so A_i = r_i
    (see ``group_mean_std``). Returns (advantages, returns), both [B, T] and equal.
    """
    _check_inputs(token_level_rewards, response_mask, group_index)
    scores = token_level_rewards.sum(-1)  # [B]
    mean, std = group_mean_std(scores, group_index)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # [B, T]
    return advantages, advantages
