"""Rollout correction: importance weights and rejection masks for the mismatch between the policy
that generated a batch (the rollout engine, π_rollout) and the one being trained (π_train).

verl's ``rollout_corr_helper`` defines the semantics and the names reproduced here:

    IS weights (``rollout_is``), from δ_t = log π_train(y_t) − log π_rollout(y_t):
      "token":     ρ_t = exp(clip(δ_t, −20, 20))
      "sequence":  ρ_t = exp(clip(Σ_t' δ_t'·m_t', −20, 20))          the same for every token
    then, with ``rollout_is_threshold`` = "U" (TIS, truncated IS) or "L_U" (IcePop):
      TIS:     ρ ← min(ρ, U)            IcePop:  ρ ← ρ·[L ≤ ρ ≤ U]
    and with ``rollout_is_batch_normalize``: ρ ← ρ / mean(ρ) (token mean, or the mean over
    sequences of their weight), so the weights average 1 over the batch. ρ carries no gradient.

    Rejection (``rollout_rs``, comma-separated options, all must pass), per token divergences
      k1 = −δ,  k2 = ½δ²,  k3 = e^δ − 1 − δ           (δ clipped to ±20)
    reduced per "token", or per sequence as "seq_sum", "seq_mean", "seq_max" (k2, k3 only):
      option "<reduction>_<k>" keeps a token when its statistic ≤ U (k2, k3) or lies in
      [log L, log U] (k1; ``rollout_rs_threshold`` "L_U", or "U" meaning L = 1/U).
    A rejected token gets mask 0 (a sequence-level option rejects the whole sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dagrl.algorithms.utils import Reducer
from dagrl.registry import Registry

SAFETY_BOUND = 20.0  # |δ| is clipped here before any exp: e^20 ≈ 4.9e8


@dataclass(frozen=True)
class RolloutCorrectionParams:
    """``algorithm.rollout_correction.*``; an empty string switches a part off."""
    rollout_is: str = ""                   # "", "token" or "sequence"
    rollout_is_threshold: str = "2.0"      # "U" (TIS) or "L_U" (IcePop)
    rollout_is_batch_normalize: bool = False
    rollout_rs: str = ""                   # "", or options such as "token_k1,seq_mean_k3"
    rollout_rs_threshold: str = ""         # one threshold, or one per option (comma-separated)
    loss_type: str = "ppo_clip"            # bypass_mode: "ppo_clip" or "reinforce"

    @property
    def active(self) -> bool:
        return bool(self.rollout_is or self.rollout_rs)


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """"U" -> (U, None) (TIS); "L_U" -> (U, L) (IcePop). Both bounds must be > 0, L ≤ U."""
    text = str(spec).strip()
    lower_text, _, upper_text = text.rpartition("_")
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else None
    except ValueError:
        raise ValueError(f"rollout_is_threshold {spec!r} must be 'U' or 'L_U' with numbers "
                         "L <= U") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r}: need 0 < L <= U")
    return upper, lower


# ------------------------------------------------------------------------ importance weights

ROLLOUT_IS_LEVELS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("rollout IS level")


@ROLLOUT_IS_LEVELS.register("token")
def _token_weights(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """ρ_t = exp(clip(δ_t, ±20)): biased (a per-token truncation), low variance."""
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))


@ROLLOUT_IS_LEVELS.register("sequence")
def _sequence_weights(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """ρ = exp(clip(Σ_t δ_t·m_t, ±20)) at every token: the sequence's likelihood ratio."""
    total = (log_ratio * mask).sum(-1, keepdim=True)  # [B, 1]
    return torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)


def rollout_is_weights(log_ratio: Tensor, mask: Tensor, level: str, threshold: str | float,
                       batch_normalize: bool = False,
                       reducer: Reducer | None = None) -> Tensor:
    """Truncated importance weights ρ [B, T] (0 outside the mask, no gradient); see the module
    docstring. ``reducer`` sums the batch-normalisation statistics over the workers."""
    upper, lower = parse_is_threshold(threshold)
    m = mask.to(log_ratio.dtype)
    raw = ROLLOUT_IS_LEVELS.get(level)(log_ratio.detach(), m) * m  # [B, T]
    if lower is None:
        weights = raw.clamp(max=upper)  # TIS
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        reduce = reducer if reducer is not None else (lambda t: t)
        if level == "sequence":
            # One weight per sequence: the mean over the sequences that have a token.
            rows = m.sum(-1) > 0
            seq_w = (weights * m).sum(-1) / m.sum(-1).clamp_min(1.0)  # [B]
            stats = reduce(torch.stack([seq_w[rows].sum(), rows.sum().to(seq_w.dtype)]))
        else:
            stats = reduce(torch.stack([(weights * m).sum(), m.sum()]))
        mean = stats[0] / stats[1].clamp_min(1e-8)
        if float(mean) > 1e-8:
            weights = weights / mean
    return weights


def is_threshold_hits(log_ratio: Tensor, mask: Tensor, level: str,
                      threshold: str | float) -> Tensor:
    """The valid tokens whose weight the threshold changed [B, T] bool: truncated at U (TIS),
    or zeroed outside [L, U] (IcePop: masked importance sampling)."""
    upper, lower = parse_is_threshold(threshold)
    m = mask.bool()
    raw = ROLLOUT_IS_LEVELS.get(level)(log_ratio.detach(), mask.to(log_ratio.dtype))
    hits = raw > upper if lower is None else (raw < lower) | (raw > upper)
    return hits & m


# ------------------------------------------------------------------------- rejection masks

# Per-token divergence estimates of KL(π_rollout ‖ π_train) from δ = log π_train − log π_rollout.
ROLLOUT_RS_DIVERGENCES: Registry[Callable[[Tensor], Tensor]] = Registry("rollout RS divergence")
ROLLOUT_RS_DIVERGENCES.add("k1", lambda d: -d)
ROLLOUT_RS_DIVERGENCES.add("k2", lambda d: 0.5 * d.square())
ROLLOUT_RS_DIVERGENCES.add("k3", lambda d: torch.exp(d) - 1.0 - d)


def _seq_max(stat: Tensor, mask: Tensor) -> Tensor:
    """max over the valid tokens, 0 for an empty row: [B, T] -> [B, T] (broadcast)."""
    top = stat.masked_fill(~mask.bool(), float("-inf")).max(-1).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    return top.unsqueeze(-1).expand_as(stat)


# How a per-token statistic becomes the one that is thresholded: per token or per sequence
# (then broadcast to its tokens).
ROLLOUT_RS_REDUCTIONS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry(
    "rollout RS reduction")
ROLLOUT_RS_REDUCTIONS.add("token", lambda stat, m: stat)
ROLLOUT_RS_REDUCTIONS.add(
    "seq_sum", lambda stat, m: (stat * m).sum(-1, keepdim=True).expand_as(stat))
ROLLOUT_RS_REDUCTIONS.add(
    "seq_mean", lambda stat, m: ((stat * m).sum(-1, keepdim=True)
                                 / (m.sum(-1, keepdim=True) + 1e-8)).expand_as(stat))
ROLLOUT_RS_REDUCTIONS.add("seq_max", _seq_max)


def rs_options(spec: str) -> list[tuple[str, str, str]]:
    """"token_k1, seq_mean_k3" -> [(name, reduction, divergence), ...], unknown names refused."""
    options = []
    for name in dict.fromkeys(o.strip() for o in spec.split(",") if o.strip()):
        reduction, _, divergence = name.rpartition("_")
        if (reduction not in ROLLOUT_RS_REDUCTIONS or divergence not in ROLLOUT_RS_DIVERGENCES
                or name == "seq_max_k1"):
            choices = [f"{r}_{k}" for r in ROLLOUT_RS_REDUCTIONS.names()
                       for k in ROLLOUT_RS_DIVERGENCES.names() if f"{r}_{k}" != "seq_max_k1"]
            raise ValueError(f"unknown rollout_rs option {name!r}; choose from "
                             f"{', '.join(choices)}")
        options.append((name, reduction, divergence))
    if not options:
        raise ValueError("rollout_rs names no option")
    return options


def rs_bounds(options: list[tuple[str, str, str]], spec: str | float) -> list[tuple[float, float]]:
    """The (low, high) bounds each option's statistic must lie in, from ``rollout_rs_threshold``:
    one entry for all options or one per option; k1 entries are ratio bounds "L_U" or "U"
    (L = 1/U), checked in log space; k2/k3 entries a single upper bound."""
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold {spec!r}: give one threshold, or one per "
                         f"rollout_rs option ({len(options)})")
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = []
    for (name, _, divergence), text in zip(options, specs, strict=True):
        lower_text, _, upper_text = text.rpartition("_")
        try:
            upper = float(upper_text)
            lower = float(lower_text) if lower_text else None
        except ValueError:
            raise ValueError(f"rollout_rs_threshold {text!r} for {name} is not a number") from None
        if divergence == "k1":
            lower = 1.0 / upper if lower is None else lower
            if not 0 < lower <= upper:
                raise ValueError(f"rollout_rs_threshold for {name}: need 0 < L <= U, got {text}")
            bounds.append((math.log(lower), math.log(upper)))
        else:
            if lower is not None or upper <= 0:
                raise ValueError(f"rollout_rs_threshold for {name} must be one upper bound > 0, "
                                 f"got {text!r}")
            bounds.append((-math.inf, upper))
    return bounds


def rejection_mask(log_ratio: Tensor, mask: Tensor, options: str,
                   thresholds: str | float) -> Tensor:
    """The response mask with the tokens every option rejects set to 0: [B, T], mask's dtype."""
    parsed = rs_options(options)
    bounds = rs_bounds(parsed, thresholds)
    delta = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m = mask.to(delta.dtype)
    keep = torch.ones_like(delta)
    for (_, reduction, divergence), (low, high) in zip(parsed, bounds, strict=True):
        stat = ROLLOUT_RS_REDUCTIONS.get(reduction)(ROLLOUT_RS_DIVERGENCES.get(divergence)(delta),
                                                    m)
        keep = keep * ((stat >= low) & (stat <= high)).to(delta.dtype)
    return (m * keep).to(mask.dtype)


def rollout_correction(log_ratio: Tensor, mask: Tensor, params: RolloutCorrectionParams,
                       reducer: Reducer | None = None) -> tuple[Tensor | None, Tensor]:
    """(IS weights [B, T] or None, response mask after rejection [B, T]) for ``params``.

    ``log_ratio`` = log π_train − log π_rollout per token. The weights are computed on the mask
    before rejection, as verl does.
    """
    weights = None
    if params.rollout_is:
        weights = rollout_is_weights(log_ratio, mask, params.rollout_is,
                                     params.rollout_is_threshold,
                                     params.rollout_is_batch_normalize, reducer)
    new_mask = mask
    if params.rollout_rs:
        new_mask = rejection_mask(log_ratio, mask, params.rollout_rs, params.rollout_rs_threshold)
    return weights, new_mask
