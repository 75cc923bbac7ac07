"""Masked reductions and logit helpers shared by the RL losses.

Shapes: B = batch of sequences, T = padded response length, V = vocabulary size. Masks are
float or bool tensors broadcastable to the values; 1 marks a real token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Sums a tensor across the workers that each hold a shard of the batch (an all-reduce with SUM)
# and returns the total; the same shape goes in and comes out. None means a single process.
Reducer = Callable[[Tensor], Tensor]


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (over everything when ``dim`` is None)."""
    masked = x * mask.to(x.dtype)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """mean = Σ x·m / Σ m over ``dim``; 0 where Σ m = 0 (an empty mask), instead of NaN."""
    total = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    # Dividing by a count forced to 1 where it is 0 keeps the gradient finite; the numerator is
    # already 0 there, so the result is 0.
    safe_count = torch.where(count > 0, count, torch.ones_like(count))
    return total / safe_count


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries: Σ m·(x − μ)² / (N − 1) (or / N if not ``unbiased``).

    N = Σ m. Needs N ≥ 2 for the unbiased estimate.
    """
    n = float(mask.sum())
    if n < (2 if unbiased else 1):
        raise ValueError(
            f"masked_var needs at least {2 if unbiased else 1} masked entries, the mask has {n:g}"
        )
    mean = masked_mean(x, mask)
    sq_dev_sum = masked_sum((x - mean) ** 2, mask)
    return sq_dev_sum / (n - 1 if unbiased else n)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten the masked entries: (x − μ) / sqrt(σ² + eps), with μ, σ² over the mask.

    σ² is the unbiased variance. With ``shift_mean=False`` the mean is added back, so only the
    scale changes: (x − μ) / sqrt(σ² + eps) + μ. Entries outside the mask are set to 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


def global_masked_whiten(
    x: Tensor,
    mask: Tensor,
    reducer: Reducer | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """``masked_whiten`` over the masked entries of *all* workers' shards, moving only sums.

    μ  = R(Σ x·m) / R(Σ m)
    σ² = R(Σ (x − μ)²·m) / (R(Σ m) − 1)          (unbiased, over the global count)
    out = (x − μ) / sqrt(σ² + eps)   (+ μ if not ``shift_mean``), 0 outside the mask

    R = ``reducer`` (identity when None). Each moment packs its sums into one tensor, so a call
    costs two reductions whatever the batch size. The variance is taken around the global mean
    in a second pass rather than from Σx² − nμ², which cancels catastrophically when |μ| ≫ σ.
    """
    reduce = reducer if reducer is not None else (lambda t: t)
    m = mask.to(x.dtype)
    first = reduce(torch.stack([(x * m).sum(), m.sum()]))  # [2] = (Σ x·m, Σ m) over all workers
    total, count = first[0], first[1]
    if float(count) < 2:
        raise ValueError(
            f"global_masked_whiten needs at least 2 masked entries over all workers, the mask has "
            f"{float(count):g}"
        )
    mean = total / count
    sq_dev_sum = reduce(((x - mean) ** 2 * m).sum().reshape(1))[0]  # [1] -> scalar
    var = sq_dev_sum / (count - 1)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) = z[label] − logsumexp(z); logits [..., V], labels [...] -> [...].

    Gathering first and subtracting logsumexp avoids materialising a full [..., V] log_softmax
    copy, which for a large vocabulary is the biggest tensor of the loss.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logprobs_from_logits: logits shape {tuple(logits.shape)} must be labels shape "
            f"{tuple(labels.shape)} plus a vocabulary dimension"
        )
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(z) per position: H = logsumexp(z) − Σ_v softmax(z)_v · z_v.

    logits [..., V] -> [...]. Equal to −Σ p log p, written so no log_softmax copy is kept.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
