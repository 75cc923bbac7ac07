"""The native decoder's ops (rollout/native_decoder.py): projections in the operand order MKL
runs fastest, RMSNorm and RoPE written for few-row decode steps, and the attention of the
packed prefill and of a decode step over the preallocated KV cache. Each keeps the memory
layout of its input ("feature-major" in decode steps, see `project`) and equals the HF
module's result up to float rounding; the measurements behind each choice are in
docs/performance.md, "Native decoder: design choices and their measurements".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dagrl.device import is_host

# Steps with fewer token rows than this run feature-major (see `_project`).
WEIGHT_MAJOR_MAX_ROWS = 512
# ... and multiply weights with more output rows than this in blocks of this many.
WEIGHT_MAJOR_CHUNK_ROWS = 4096
# Prefill attention materialises its [A, heads, P, P] scores up to this many elements (64 MiB
# in float32), faster than SDPA's CPU kernel for short prompts; longer prompts use SDPA.
MATH_ATTENTION_MAX_SCORES = 2**24


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear: x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], with MKL's faster operand order.

    Few rows on the host CPU (decoding, M < WEIGHT_MAJOR_MAX_ROWS): computed as (W @ x^T)^T,
    which MKL's sgemm runs faster than x @ W^T. The result is a transposed view
    ("feature-major" memory): the decoder keeps its whole residual stream in that layout, so
    elementwise ops never mix layouts. Many rows (prefill) keep F.linear, which is faster
    there. The operand is padded to a fast row count (`_sgemm_operand`). The results equal
    F.linear's bit for bit at 1 and at 12 or more rows on this build (SmolLM2's shapes) and
    by float rounding at 2-11. Measurements: docs/performance.md.
    """
    if x.shape[0] >= WEIGHT_MAJOR_MAX_ROWS or not _weight_major_pays(x):
        return F.linear(x, weight, bias)
    rows, operand = x.shape[0], _sgemm_operand(x)
    if weight.shape[0] <= WEIGHT_MAJOR_CHUNK_ROWS:
        out = torch.mm(weight, operand.t())                            # [N, M']
    else:
        # A large weight in blocks of rows: MKL blocks one huge product less well (same sums).
        out = x.new_empty(weight.shape[0], operand.shape[0])
        for start in range(0, weight.shape[0], WEIGHT_MAJOR_CHUNK_ROWS):
            stop = start + WEIGHT_MAJOR_CHUNK_ROWS
            torch.mm(weight[start:stop], operand.t(), out=out[start:stop])
    out = out[:, :rows].t()                                            # [M, N], strides (1, M')
    return out if bias is None else out + bias


def _sgemm_operand(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the right operand of W @ x^T that MKL's AVX2 sgemm runs fastest: [M', K]
    row-major (x^T then a transposed view), its rows zero-padded to a multiple of 8 above 4.

    Few-row products cost by M's residue more than by its size. SmolLM2's 30 decoder layers
    (W @ x^T, 2 threads): 25-33 ms at 1-4 rows row-major, but 72-108 ms at 2-11 rows
    feature-major, the decoder's layout; from 12 rows the layout does not matter and 16, 24, 32
    rows take 39, 55, 57 ms against up to 106 ms at the counts between (31 rows), and the
    same holds to 512 rows (docs/performance.md). The copy is at most [M', K] floats; the zero
    rows' products are sliced off, and no real row's sums involve them.
    """
    rows = x.shape[0]
    padded = rows if rows <= 4 or rows % 8 == 0 else -(-rows // 8) * 8
    if padded == rows:   # 1-4 and 8 rows row-major (no copy when they are); 16, 24, ... as is
        return x.contiguous() if rows <= 8 else x
    operand = x.new_zeros(padded, x.shape[1])
    operand[:rows] = x
    return operand


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits x [M, H] @ weight [V, H]^T -> [M, V] row-major (the sampler reduces over V).

    Decode-sized steps on CPU take `project`'s W @ x^T order in blocks of vocabulary rows,
    each block transposed into the row-major result while it is still in cache: faster than
    one transposing copy of the whole [V, M] product, same values (docs/performance.md).
    """
    rows = x.shape[0]
    if rows >= WEIGHT_MAJOR_MAX_ROWS or not _weight_major_pays(x) \
            or weight.shape[0] <= WEIGHT_MAJOR_CHUNK_ROWS:
        return project(x, weight, None).contiguous()
    out = x.new_empty(rows, weight.shape[0])
    operand = _sgemm_operand(x)
    block = x.new_empty(WEIGHT_MAJOR_CHUNK_ROWS, operand.shape[0])
    for start in range(0, weight.shape[0], WEIGHT_MAJOR_CHUNK_ROWS):
        part = weight[start:start + WEIGHT_MAJOR_CHUNK_ROWS]
        torch.mm(part, operand.t(), out=block[:part.shape[0]])
        out[:, start:start + part.shape[0]].copy_(block[:part.shape[0], :rows].t())
    return out


def _weight_major_pays(x: torch.Tensor) -> bool:
    """The operand-order choice is measured on the host CPU (MKL); accelerators keep F.linear."""
    return is_host(x)


def rms_norm(x: torch.Tensor, root_h_weight: torch.Tensor, h_eps: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last axis, x * rsqrt(mean x^2 + eps) * w, written as
    x * rsqrt(sum x^2 + H eps) * (sqrt(H) w) with `root_h_weight` = sqrt(H) w and `h_eps` =
    H eps (a 0-dim tensor of x's dtype) precomputed: a sum is cheaper than a mean on these
    small tensors, and a tensor epsilon skips wrapping and casting a Python scalar on every
    call (docs/performance.md). The result keeps x's memory layout; it differs from HF's by
    float rounding only."""
    return x * (x * x).sum(-1, keepdim=True).add_(h_eps).rsqrt_() * root_h_weight


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention) in 4 ops: x [M, heads, hd], cos/signed_sin [M, 1, hd]
    in x's memory layout (feature-major in decode steps: one layout, so the ops vectorise).

    HF's rotate_half(x) * sin = cat(-x2, x1) * sin = roll(x, hd/2) * cat(-sin1, sin2): the sign
    moves into the table (exact in floating point), saving the negation and the concatenation.
    `roll` writes a row-major result; on a feature-major x it runs on the permuted (contiguous)
    view instead, so its result keeps x's layout (faster; see docs/performance.md).
    """
    half = x.shape[-1] // 2
    if is_feature_major(x):
        rolled = x.permute(1, 2, 0).roll(half, dims=1).permute(2, 0, 1)
    else:
        rolled = x.roll(half, dims=-1)
    return x * cos + rolled * signed_sin


def is_feature_major(x: torch.Tensor) -> bool:
    return x.shape[0] > 1 and x.stride(0) == 1


def feature_major(x: torch.Tensor) -> torch.Tensor:
    """The same [M, H] values stored transposed (strides (1, M)), the decoder's layout for
    few-row steps (see `project`)."""
    return x.t().contiguous().t()


@dataclass
class PrefillAttention:
    """Causal attention over packed prompt tokens: token m sits in cache row `row[m]`, column
    `col[m]`; only real tokens run through the projections and MLPs (no padding compute).

    The attention itself runs padded, [A, heads, P, hd]: queries are scattered into a zero
    tensor and `bias` [A, 1, P, P] masks future and padding columns (pad query rows attend to
    themselves, so no softmax row is empty; their outputs are never gathered). Short prompts
    use plain matmul-softmax-matmul, faster than SDPA's CPU kernel there (docs/performance.md);
    long ones SDPA, which never holds the [A, heads, P, P] scores.
    """
    row: torch.Tensor      # [M]
    col: torch.Tensor      # [M]
    bias: torch.Tensor     # [A, 1, P, P] additive, 0 or -inf

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        """q [M, nh, hd], k/v [M, nkv, hd]; caches [A, nkv, hd, S] (keys, transposed) and
        [A, nkv, S, hd] (values) -> attention output [M, nh*hd]."""
        rows, _, cols, _ = self.bias.shape
        k_cache[self.row, :, :, self.col] = k
        v_cache[self.row, :, self.col] = v
        nh, hd, nkv = q.shape[1], q.shape[2], k.shape[1]
        padded_q = q.new_zeros(rows, cols, nkv, nh // nkv, hd)
        padded_q[self.row, self.col] = q.view(-1, nkv, nh // nkv, hd)    # [A, P, nkv, g, hd]
        if rows * nh * cols * cols > MATH_ATTENTION_MAX_SCORES:
            att = F.scaled_dot_product_attention(
                padded_q.flatten(2, 3).transpose(1, 2), k_cache[..., :cols].transpose(-1, -2),
                v_cache[:, :, :cols],
                attn_mask=self.bias, enable_gqa=nh != nkv)      # [A, nh, P, hd]
            return att.transpose(1, 2)[self.row, self.col].flatten(1)
        # Query heads that share a KV head fold into the query axis: [A, nkv, g*P, hd].
        grouped = padded_q.permute(0, 2, 3, 1, 4).reshape(rows, nkv, -1, hd)
        scores = torch.matmul(grouped, k_cache[..., :cols])                     # [A, nkv, g*P, P]
        scores = scores.view(rows, nkv, nh // nkv, cols, cols).mul_(hd ** -0.5)
        probs = scores.add_(self.bias[:, :, None]).softmax(-1).view(rows, nkv, -1, cols)
        att = torch.matmul(probs, v_cache[:, :, :cols]).view(rows, nkv, nh // nkv, cols, hd)
        return att[self.row, :, :, self.col].flatten(1)                  # [M, nh*hd]


@dataclass
class DecodeAttention:
    """Attention of one new token per active row over cache columns 0..col."""
    col: int
    bias: torch.Tensor     # [A * nkv, 1, col + 1] additive: -inf at prompt padding

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        """q [A, nh, hd], k/v [A, nkv, hd]; caches [A, nkv, hd, S] (keys, transposed) and
        [A, nkv, S, hd] (values) -> attention output [A, nh*hd]."""
        rows, nh, hd = q.shape
        nkv = k.shape[1]
        k_cache[..., self.col] = k
        v_cache[:, :, self.col] = v
        # One (row, KV head) pair per batch entry, [A*nkv, ...]; the query heads that share a
        # KV head fold into the query axis, so GQA needs no copy of the cache. Plain
        # matmul-softmax-matmul: for a one-token query SDPA's CPU kernel costs more per call
        # than the math; baddbmm scales and adds the padding bias inside the product (two fewer
        # ops per layer). Keys are cached transposed, so each batch entry's K^T is a plain
        # row-major [hd, c] slice, which makes the product faster (docs/performance.md).
        keys_t = k_cache[..., :self.col + 1].flatten(0, 1)               # [A*nkv, hd, c]
        values = v_cache[:, :, :self.col + 1].flatten(0, 1)              # [A*nkv, c, hd]
        scores = torch.baddbmm(self.bias, q.reshape(rows * nkv, nh // nkv, hd), keys_t,
                               alpha=hd ** -0.5)                         # [A*nkv, g, c]
        return torch.bmm(scores.softmax(-1), values).view(rows, nh * hd)


def to_step_layout(x: torch.Tensor) -> torch.Tensor:
    """Token rows [M, H] in the layout the decoder keeps for a step of M rows: feature-major
    when M is decode-sized on the host (see `project`), else as they are."""
    few_rows = x.shape[0] < WEIGHT_MAJOR_MAX_ROWS and _weight_major_pays(x)
    return feature_major(x) if few_rows else x
