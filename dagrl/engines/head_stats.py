"""The LM head's per-token statistics with a hand-written backward: hidden states in, (log-prob
of the target, entropy, Σ_v p_v²) out, the numbers autograd would compute.

    z   = (W h + b) / T                       [n, V] float32 (the matmul in autocast's dtype)
    lse = logsumexp(z),  log p = z − lse,  p = exp(log p)
    out = (log p_y,  H = lse − Σ_v p_v z_v,  S = Σ_v p_v²)

    ∂/∂z_v:  log p_y → δ_vy − p_v,   H → −p_v (log p_v + H),   S → 2 p_v (p_v − S)

Why not autograd: the head is a small matmul ([n, 576] x [576, 49152] for SmolLM2) followed by
a dozen elementwise passes over [n, V] float32, and autograd keeps each pass's result or (under
the activation checkpointing this replaces) runs them all again in backward, then a dozen more
for their gradients, each pass a fresh tensor of tens of MiB. Here the forward keeps three [n]
vectors; the backward recomputes the logits once and turns them into the gradient in place,
in scratch tensors kept between calls (`_Workspace`). SmolLM2's head over 768 tokens in
bfloat16, forward and backward: 1.39 s through autograd, 0.41 s here (scripts/head_probe.py,
docs/performance.md).

At most one chunk's [chunk, V] logits, their float32 copy and probabilities are alive, as
under checkpointing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from dagrl.device import is_host
from dagrl.engines.precision import matmul_dtype


class _Workspace(threading.local):
    """Scratch tensors of the head passes on the host, kept from call to call (one set per
    thread). A chunk's [n, V] tensors are tens of MiB: allocated afresh each time they come
    from a new mapping whose pages the kernel faults in and zeroes, which cost SmolLM2's
    bfloat16 update about as much as the arithmetic on them (dagrl maps blocks that large on
    their own: engines/host_memory.py). Kept, they cost their size once: one chunk's logits,
    its float32 copy and probabilities, and (under autocast) a weight-sized cast and gradient.
    The worker drops them between nodes with trainer.trim_host_memory (`release_workspace`).
    Accelerator tensors are not kept: their caching allocators reuse blocks already."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
        if not is_host(like):
            return torch.empty(shape, dtype=dtype, device=like.device)
        size = math.prod(shape)
        kept = self.tensors.get(name)
        if kept is None or kept.dtype != dtype or kept.device != like.device \
                or kept.numel() < size:
            kept = self.tensors[name] = torch.empty(size, dtype=dtype, device=like.device)
        return kept[:size].view(shape)


_WORKSPACE = _Workspace()


def release_workspace() -> None:
    """Drop this thread's kept scratch tensors (the next head pass allocates them again)."""
    _WORKSPACE.tensors.clear()


def _cast(name: str, t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`t` in `dtype`, in the workspace when it needs a copy."""
    if t is None or t.dtype == dtype:
        return t
    return _WORKSPACE.get(name, tuple(t.shape), t, dtype).copy_(t)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            temperature: float, removed: torch.Tensor | None) -> torch.Tensor:
    """z = (W h + b) / T [n, V] as float32 in the workspace, the matmul in hidden's dtype;
    the removed tokens at float32's lowest value (probability 0 with no inf: an entropy's
    0 * -inf would be NaN)."""
    shape = (hidden.shape[0], weight.shape[0])
    out = _WORKSPACE.get("logits", shape, hidden, hidden.dtype)
    if bias is None:
        torch.mm(hidden, weight.t(), out=out)
    else:               # as F.linear: the bias added before the product's one rounding
        torch.addmm(bias, hidden, weight.t(), out=out)
    z = out if out.dtype == torch.float32 else \
        _WORKSPACE.get("z", shape, hidden, torch.float32).copy_(out)
    if temperature != 1.0:
        z.div_(temperature)
    if removed is not None:
        z.index_fill_(-1, removed, torch.finfo(z.dtype).min)
    return z


def _chunks(n: int, chunk: int) -> list[slice]:
    step = chunk if chunk > 0 else max(n, 1)
    return [slice(i, i + step) for i in range(0, n, step)]


class _HeadTokenStats(torch.autograd.Function):
    """Over [N, H] hidden states in chunks of `chunk` rows (0: all at once). Autocast's dtype
    at the forward is the matmuls' dtype in both passes, as autograd's would be; the weight
    is cast to it once per pass, not once per chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, with_sum_sq,
                removed, chunk):
        device = hidden.device.type
        dtype = matmul_dtype(hidden)
        n = hidden.shape[0]
        lse, logp = (hidden.new_zeros(n, dtype=torch.float32) for _ in range(2))
        # What was not asked for stays a constant 0 (no gradient goes back through it).
        entropy, sum_sq = torch.zeros_like(lse), torch.zeros_like(lse)
        with torch.autocast(device, enabled=False):   # float32 after the matmul
            w, b = _cast("weight", weight, dtype), _cast("bias", bias, dtype)
            for rows in _chunks(n, chunk):
                z = _logits(hidden[rows].to(dtype), w, b, temperature, removed)
                top = z.amax(dim=-1)
                e = _WORKSPACE.get("p", tuple(z.shape), z, torch.float32)
                torch.sub(z, top[:, None], out=e).exp_()                 # exp(z − max)
                total = e.sum(dim=-1)
                lse[rows] = top + total.log()
                logp[rows] = z.gather(-1, targets[rows, None])[:, 0] - lse[rows]
                if with_entropy or with_sum_sq:
                    p = e.div_(total[:, None])
                    if with_sum_sq:
                        sum_sq[rows] = torch.linalg.vecdot(p, p)
                    if with_entropy:   # Σ p z in p's storage: a reduction, not a BLAS dot,
                        # whose long running sums lose ~1e-3 of an entropy over 49k tokens
                        entropy[rows] = lse[rows] - p.mul_(z).sum(dim=-1)
        ctx.mark_non_differentiable(*[t for t, asked in ((entropy, with_entropy),
                                                         (sum_sq, with_sum_sq)) if not asked])
        ctx.dtype, ctx.temperature, ctx.chunk = dtype, temperature, chunk
        ctx.with_entropy, ctx.with_sum_sq = with_entropy, with_sum_sq
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, sum_sq, removed)
        ctx.set_materialize_grads(False)
        return logp, entropy, sum_sq

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_sum_sq):
        hidden, weight, bias, targets, lse, entropy, sum_sq, removed = ctx.saved_tensors
        dtype, temperature = ctx.dtype, ctx.temperature
        grads = (g_logp, g_entropy if ctx.with_entropy else None,
                 g_sum_sq if ctx.with_sum_sq else None)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_h else None   # every row is written
        grad_weight = grad_bias = None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = _cast("weight", weight, dtype), _cast("bias", bias, dtype)
            for rows in _chunks(hidden.shape[0], ctx.chunk):
                h = hidden[rows].to(dtype)
                logp = _logits(h, w, b, temperature, removed).sub_(lse[rows, None])  # log p
                dz = _logit_grad(logp, targets[rows], entropy[rows], sum_sq[rows],
                                 *(g[rows] if g is not None else None for g in grads))
                if temperature != 1.0:
                    dz.div_(temperature)
                dz = _cast("dz", dz, dtype)
                if want_h:
                    grad_hidden[rows] = dz @ w
                if want_w:
                    grad_weight = _weight_grad(grad_weight, dz, h, weight.dtype)
                if want_b and bias is not None:
                    grad_bias = _accumulate(grad_bias, dz.sum(0), bias.dtype)
        if want_w and grad_weight is None:           # no rows
            grad_weight = torch.zeros_like(weight)
        if want_b and bias is not None and grad_bias is None:
            grad_bias = torch.zeros_like(bias)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _weight_grad(total: torch.Tensor | None, dz: torch.Tensor, h: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """total + dz^T h, the weight's gradient summed over chunks in the weight's `dtype`. In the
    matmul's dtype the product goes straight into the returned tensor (no [V, H] scratch: one
    weight-sized float32 tensor less for SmolLM2's 108 MiB head). Otherwise each chunk's
    product goes into a kept scratch tensor in the matmul's dtype and is added in `dtype`."""
    if dz.dtype == dtype:
        return torch.mm(dz.t(), h) if total is None else total.addmm_(dz.t(), h)
    part = torch.mm(dz.t(), h, out=_WORKSPACE.get("grad_weight", (dz.shape[1], h.shape[1]),
                                                     h, dz.dtype))
    return _accumulate(total, part, dtype)


def _accumulate(total: torch.Tensor | None, part: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    # The first chunk's part becomes the total (no zero-filled [V, H] to add it to).
    return part.to(dtype, copy=True) if total is None else total.add_(part)


def _logit_grad(logp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor,
                sum_sq: torch.Tensor, g_logp: torch.Tensor | None,
                g_entropy: torch.Tensor | None, g_sum_sq: torch.Tensor | None) -> torch.Tensor:
    """∂L/∂z [n, V] from log p [n, V], in place (the result lives in `logp`'s storage):
    g_logp (δ_y − p) − g_H p (log p + H) + g_S 2 p (p − S). p (log p + H) is bounded
    (|p log p| <= 1/e), so a removed token's 0 * (lowest value) is 0 before any scaling."""
    p = torch.exp(logp, out=_WORKSPACE.get("p", tuple(logp.shape), logp, torch.float32))
    if g_entropy is not None:
        dz = logp.add_(entropy[:, None]).mul_(p).mul_(-g_entropy[:, None])
    else:
        dz = logp.zero_()
    if g_logp is not None:
        dz.addcmul_(p, -g_logp[:, None])
        dz.scatter_add_(-1, targets[:, None], g_logp[:, None])
    if g_sum_sq is not None:       # only when Σp² is differentiated (no built-in loss does)
        dz.add_((p - sum_sq[:, None]).mul_(p).mul_(2 * g_sum_sq[:, None]))
    return dz


def head_token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     targets: torch.Tensor, temperature: float, with_entropy: bool,
                     with_sum_pi_squared: bool = False, removed: Sequence[int] = (),
                     chunk_tokens: int = 0) -> torch.Tensor:
    """hidden [N, H], targets [N] -> [N, 3] = (log softmax(z/T)[y], entropy of softmax(z/T),
    Σ_v softmax(z/T)_v²) with z = W h + b and the `removed` tokens' z at the lowest value; the
    last two are 0 unless asked for. Differentiable in hidden, weight and bias. At most
    `chunk_tokens` rows of [rows, V] logits are alive at once (0: all N)."""
    index = (torch.tensor(list(removed), device=hidden.device, dtype=torch.long)
             if removed else None)
    logp, entropy, sum_sq = _HeadTokenStats.apply(hidden, weight, bias, targets, temperature,
                                                  with_entropy, with_sum_pi_squared, index,
                                                  chunk_tokens)
    return torch.stack([logp, entropy, sum_sq], dim=-1)
