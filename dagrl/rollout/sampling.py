"""Token sampling whose randomness belongs to the *sample*, not to the batch.

Each sequence carries a 62-bit `sample_seed` (derived from the run seed, the step, the prompt's
dataset row and the sample's index within its group). The random number used at decode
position t is a hash of (sample_seed, t), so a sequence draws exactly the same tokens whether it
is generated alone, in a batch of 8 on one worker, or in a batch of 2 on one of four workers.
That is what makes a run reproducible and N-worker runs match a 1-worker run sample for sample.

Sampling inverts the CDF of softmax(z / T) with that one uniform number per token. (The
Gumbel-max trick needs one per vocabulary entry: hashing 49k of them per token cost 10% of a
SmolLM2 rollout.) Top-k / top-p set the excluded logits to -inf first. Everything is vectorised
over the batch and the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_C = 0x45D9F3B  # multiplier of a well-mixing 32-bit integer hash; < 2**27 so int64 never overflows


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _C & _M32
    x = ((x >> 16) ^ x) * _C & _M32
    return (x >> 16) ^ x


def mix_seed(*parts: int | torch.Tensor) -> torch.Tensor | int:
    """Combine integers (or int64 tensors, broadcast) into one well-mixed 32-bit value."""
    h: torch.Tensor | int = 0x9E3779B9
    # The first tensor part's device (an accelerator's tensor beside host integers).
    device = next((p.device for p in parts if isinstance(p, torch.Tensor)), None)
    for part in parts:
        h_t = torch.as_tensor(h, dtype=torch.int64, device=device)
        p_t = torch.as_tensor(part, dtype=torch.int64, device=device) & _M32
        h = _hash32((h_t ^ p_t) + 0x7F4A7C15 & _M32)
    return h


def uniform_draws(sample_seed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """u[b, i] in [0, 1), float64 with 53 random bits, for sequence b at decode position
    start + i: [B] -> [B, count]. One draw per token: the sampler inverts the CDF with it.

    u = (hi >> 5) * 2^-27 + (lo >> 6) * 2^-53
    with hi = h(seed_b ^ h(t + 1)), lo = h(hi ^ 0x5bd1e995).
    """
    positions = torch.arange(start, start + count, device=sample_seed.device, dtype=torch.int64)
    hi = _hash32((sample_seed[:, None] & _M32) ^ _hash32(positions + 1)[None, :])   # [B, C]
    lo = _hash32(hi ^ 0x5BD1E995)
    return ((hi >> 5) * (1 << 26) + (lo >> 6)).to(torch.float64) / float(1 << 53)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logprob_temperature(temperature: float) -> float:
    """The T of the log-probs log softmax(z / T) that rollout records and training recomputes:
    the sampling temperature, and 1 for greedy decoding (temperature 0), whose tokens are the
    argmax of any T."""
    return temperature if temperature > 0 else 1.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf. [B, V] -> [B, V].

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p; the
    most likely token is always kept.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next_token(logits: torch.Tensor, params: SamplingParams, sample_seed: torch.Tensor,
                      position: int, u: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from logits [B, V] (already masked for min-length etc.) -> [B].

    Inverse-CDF sampling: with p = softmax(filter(z / T)) and its running sum c_v = sum_{w<=v} p_w,
    the token is the first v with c_v > u * c_{V-1}, u ~ U[0, 1) from `uniform_draws` (given as
    `u` [B] when already drawn). Token v is drawn with probability p_v; a masked token (p = 0)
    never is. p is float32 (a float64 softmax costs 13x more: 5.8 ms per SmolLM2 step), the
    running sum float64, so summing 49k terms adds no rounding drift.
    """
    if params.greedy:
        return logits.argmax(-1)
    scaled = logits.float()
    if params.temperature != 1.0:
        scaled = scaled / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        scaled = filter_logits(scaled, params.top_k, params.top_p)
    if u is None:
        u = uniform_draws(sample_seed, position, 1)[:, 0]
    cdf = scaled.softmax(-1).cumsum(-1, dtype=torch.float64)             # [B, V]
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)                # [B, 1]
    # u < 1, so target <= total and the clamp only guards a rounding tie at the very end.
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
