"""Token positions of left-padded rows. Torch alone: the rollout backends and the vision inputs
use it without importing the Batch container (and tensordict with it)."""

from __future__ import annotations

from torch import Tensor


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: [B, L] mask -> [B, L] ids (0 at the first real token)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
