"""DAPO's reward shaping and sample filtering (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale")."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    lengths: Tensor,
    *,
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO's soft overlong punishment (Sec. 3.4), per response length L: [B] -> [B].

    R(L) = 0                                    L ≤ L_max − L_cache
    R(L) = ((L_max − L_cache) − L) / L_cache    L_max − L_cache < L ≤ L_max
    R(L) = −1                                   L > L_max

    scaled by ``penalty_factor``; L_max = ``max_len``, L_cache = ``buffer_len``. The linear ramp
    over the buffer tells a slightly long answer from a truncated one instead of giving every
    truncated sample the same hard penalty as a wrong answer.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
    length = lengths.to(torch.float32)
    expected = max_len - buffer_len
    ramp = (expected - length) / buffer_len  # [B]; ≤ 0 past the expected length
    penalty = torch.where(length <= expected, torch.zeros_like(length), ramp)
    penalty = torch.where(length > max_len, torch.full_like(length, -1.0), penalty)
    return penalty * penalty_factor


def groups_with_variance(scores: Tensor, group_index: Tensor) -> Tensor:
    """DAPO's dynamic-sampling test (Sec. 3.2, 0 < |{o_i correct}| < G): [B], [B] -> bool [B].

    True for the samples whose group's scores are not all equal. A group whose samples all got
    the same score has zero group-relative advantage, so it adds no gradient, only noise to
    the batch size; a group of one sample counts as all-equal.
    """
    if scores.dim() != 1 or group_index.shape != scores.shape:
        raise ValueError(
            f"scores and group_index must both be [B], got {tuple(scores.shape)} and "
            f"{tuple(group_index.shape)}"
        )
    if group_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_index must be an integer tensor, got dtype {group_index.dtype}")
    index = group_index.long()
    num_groups = int(index.max()) + 1 if index.numel() else 0
    empty = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    group_max = empty.scatter_reduce(0, index, scores, "amax", include_self=False)  # [G]
    group_min = empty.scatter_reduce(0, index, scores, "amin", include_self=False)
    return group_max[index] > group_min[index]
