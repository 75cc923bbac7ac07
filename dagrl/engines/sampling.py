"""Token sampling whose randomness belongs to the *sample*, not to the batch.

Each sequence carries a 62-bit `sample_seed` (derived from the run seed, the step, the prompt's
dataset row and the sample's index within its group). The noise used at decode position t is a
hash of (sample_seed, t, token id), so a sequence draws exactly the same tokens whether it is
generated alone, in a batch of 8 on one worker, or in a batch of 2 on one of four workers. That
is what makes a run reproducible and N-worker runs match a 1-worker run sample for sample.

Sampling uses the Gumbel-max trick: argmax_v (z_v / T + g_v) with g_v = -log(-log u_v),
u_v ~ U(0,1) i.i.d., is a draw from softmax(z / T). Top-k / top-p set the excluded logits to
-inf first. Everything is vectorised over the batch and the vocabulary.
"""

from __future__ import annotations

import functools
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
    for part in parts:
        h_t = torch.as_tensor(h, dtype=torch.int64)
        p_t = torch.as_tensor(part, dtype=torch.int64) & _M32
        h = _hash32((h_t ^ p_t) + 0x7F4A7C15 & _M32)
    return h


def uniform_block(sample_seed: torch.Tensor, start: int, count: int,
                  vocab_size: int) -> torch.Tensor:
    """u[b, i, v] in (0, 1) for sequence b at decode position start + i: [B] -> [B, count, V].

    24 random bits per entry: the smallest probability the sampler can resolve is ~6e-8.
    A decoder draws a block of positions in one pass instead of ~25 small ops per token.
    """
    device = sample_seed.device
    positions = torch.arange(start, start + count, device=device, dtype=torch.int64)
    row = _hash32((sample_seed[:, None] & _M32) ^ _hash32(positions + 1)[None, :])   # [B, C]
    h = _hash32((row[:, :, None] ^ _vocab_hash(vocab_size, device)[None, None, :]) & _M32)
    return ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def uniform_noise(sample_seed: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """u[b, v] for sequence b at decode `position`: [B] -> [B, V] float32."""
    return uniform_block(sample_seed, position, 1, vocab_size)[:, 0]


def gumbel_block(sample_seed: torch.Tensor, start: int, count: int,
                 vocab_size: int) -> torch.Tensor:
    """Gumbel noise -log(-log u) of `uniform_block`: [B] -> [B, count, V]."""
    return -torch.log(-torch.log(uniform_block(sample_seed, start, count, vocab_size)))


@functools.lru_cache(maxsize=8)
def _vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    vocab = torch.arange(vocab_size, device=device, dtype=torch.int64)
    return _hash32(vocab * 0x9E3779B1 & _M32)                                # [V]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
                      position: int, gumbel: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from logits [B, V] (already masked for min-length etc.) -> [B].
    `gumbel` [B, V]: this position's noise if already drawn (`gumbel_block`)."""
    if params.greedy:
        return logits.argmax(-1)
    scaled = logits.float()
    if params.temperature != 1.0:
        scaled = scaled / params.temperature
    scaled = filter_logits(scaled, params.top_k, params.top_p)
    if gumbel is None:
        gumbel = gumbel_block(sample_seed, position, 1, logits.shape[-1])[:, 0]
    return (scaled + gumbel).argmax(-1)
