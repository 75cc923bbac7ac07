"""Reduce a per-token loss matrix [B, T] to a scalar, by a mode registered in ``LOSS_AGG``.

Each mode is a numerator N(l, m) summed over the local batch, divided by a denominator D.
By default D is the local one (``agg_denominator``). A trainer that splits a mini-batch into
micro-batches (and ranks) passes the *global* D of the whole mini-batch as ``denom`` instead:
since N is a sum over sequences, Σ_micro N_micro / D_global = N_full / D_global, so the
micro-batch losses (and their gradients) add up exactly to the full-batch loss.

The names and the conventions are verl's (``core_algos.agg_loss``): the ``seq-mean-*`` modes
average over the rows that have at least one valid token, so a row the mask empties (all
padding, or every token rejected) does not dilute the mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from dagrl.registry import Registry, UnknownNameError


@dataclass(frozen=True)
class AggMode:
    numerator: Callable[[Tensor, Tensor, int], Tensor]  # (loss [B,T], mask [B,T], L) -> scalar
    local_denominator: Callable[[Tensor], float]  # mask [B,T] -> D


LOSS_AGG: Registry[AggMode] = Registry("loss aggregation mode")


def _num_tokens(mask: Tensor) -> float:
    return float(mask.sum())


def _num_valid_rows(mask: Tensor) -> float:
    """Rows with at least one valid token (verl's ``seq_mask.sum()``)."""
    return float((mask.sum(-1) > 0).sum())


def _no_normaliser(mask: Tensor) -> float:
    # token-sum divides by nothing. Its D is 0 on every rank, so the summed D is 0 and
    # agg_loss floors it to 1 like any empty denominator: the loss is the plain sum.
    return 0.0


def _token_sum(loss: Tensor, mask: Tensor, max_len: int) -> Tensor:
    return (loss * mask).sum()


def _seq_token_mean_sum(loss: Tensor, mask: Tensor, max_len: int) -> Tensor:
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)  # [B]; an empty row gives 0
    return per_seq.sum()


def _token_sum_norm(loss: Tensor, mask: Tensor, max_len: int) -> Tensor:
    return (loss * mask).sum() / max_len


LOSS_AGG.add("token-mean", AggMode(_token_sum, _num_tokens))
LOSS_AGG.add("token-sum", AggMode(_token_sum, _no_normaliser))
LOSS_AGG.add("seq-mean-token-sum", AggMode(_token_sum, _num_valid_rows))
LOSS_AGG.add("seq-mean-token-mean", AggMode(_seq_token_mean_sum, _num_valid_rows))
LOSS_AGG.add("seq-mean-token-sum-norm", AggMode(_token_sum_norm, _num_valid_rows))

LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "token-sum", "seq-mean-token-sum",
                                   "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _get_mode(mode: str) -> AggMode:
    try:
        return LOSS_AGG.get(mode)
    except UnknownNameError as err:
        raise ValueError(str(err)) from None


def agg_denominator(mask: Tensor, mode: str) -> float:
    """Local denominator D of ``mode`` for ``mask`` [B, T]: Σ m for "token-mean", the number of
    rows with a valid token for the ``seq-mean-*`` modes, 0 (no normaliser) for "token-sum"."""
    return _get_mode(mode).local_denominator(mask)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    denom: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Aggregate ``loss_mat`` [B, T] over ``mask`` [B, T] into a scalar.

    With l = loss_mat, m = mask, D = ``denom`` (default: the local D of the mode) and
    B' = the number of rows with Σ_t m > 0:

    "token-mean":               Σ_{i,t} l·m / D                         local D = Σ_{i,t} m
    "token-sum":                Σ_{i,t} l·m                             (D = 1)
    "seq-mean-token-sum":       Σ_i (Σ_t l·m) / D                       local D = B'
    "seq-mean-token-mean":      Σ_i (Σ_t l·m / max(Σ_t m, 1)) / D       local D = B'
    "seq-mean-token-sum-norm":  Σ_i (Σ_t l·m) / (D · L)                 local D = B'  (Dr.GRPO)

    L = ``max_len`` (default ``mask.shape[-1]``); it must be the same constant for every
    micro-batch of a mini-batch, so pass the configured max response length when micro-batches
    are padded to different lengths. D is floored at 1: it counts tokens or sequences, so it is
    only below 1 for an empty mask, where the numerator is 0 too and the loss is 0, not NaN.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"agg_loss: loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both "
            f"be [B, T]"
        )
    agg = _get_mode(mode)
    if max_len is None:
        max_len = mask.shape[-1]
    elif max_len < 1:
        raise ValueError(f"agg_loss: max_len must be >= 1, got {max_len}")
    m = mask.to(loss_mat.dtype)
    numerator = agg.numerator(loss_mat, m, max_len)
    d = agg.local_denominator(m) if denom is None else denom
    d = d.clamp_min(1.0) if isinstance(d, Tensor) else max(float(d), 1.0)
    return numerator / d
