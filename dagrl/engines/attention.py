"""Grouped matmul-softmax attention for the teacher-forced passes of short sequences on CPU,
registered with transformers as the attention implementation `dagrl_grouped`.

    attention(Q, K, V) = softmax(Q K^T * scale + mask) V       per head

Query heads that share a KV head (GQA) are folded into the query axis, [B, nkv, g*T, hd], so
the keys and values are never repeated (HF's `eager` copies them nh/nkv times), and no dropout
op runs. For RL batches of short sequences this is faster than SDPA's CPU kernel, whose fixed
cost per call dominates there: the e2e benchmark's update (64 x 39 tokens, 4 layers) takes
150 -> 139 ms forward and backward, 139 -> 122 ms with compiled layers. Above `MAX_SCORES`
elements of scores it hands over to SDPA, which never materialises them.

Backward keeps only Q, K and V (and the mask, one for all layers) and recomputes the
probabilities, as flash attention does. Autograd through the textbook ops would keep the [T, S]
probabilities of every head and layer until backward, in float32 and again in bfloat16 under
autocast: half of the update's activations on SmolLM2 (a shared-prompt row of 572 tokens: 505
of 1006 MiB in bfloat16, 337 of 1070 MiB in float32). The recompute costs one [T, S] matmul and
softmax per layer in backward; the forward's in-place softmax input pays for it (one such row,
float32, 2 threads: forward and backward of the model as fast as before).

A shared-prompt micro-batch (shared_prompts.py) also passes `attention_blocks`: its rows' tree
mask leaves every response's scores against the row's other responses masked, most of the row's
[T, T] scores, so the kernel computes the dense blocks that hold the allowed ones instead
(cascade attention): SmolLM2, one group of 60 + 4 x 128 tokens, float32, 2 threads, forward
and backward of the model 6.94 -> 5.34 s (`python scripts/update_memory_probe.py --repeat 4`,
the rows and the blocks taking turns).

`resolve_attn_implementation("auto", device)` picks it on CPU and SDPA elsewhere (GPU kernels
are fused and fast there).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from dagrl.device import is_host
from dagrl.engines.precision import matmul_dtype
from dagrl.engines.shared_prompts import AttentionBlocks, ResponseBlock

NAME = "dagrl_grouped"
# Materialise at most this many score elements (64 MiB in float32); longer inputs use SDPA.
MAX_SCORES = 2**24
CHOICES = ("auto", "sdpa", "eager", NAME)


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      attention_blocks: AttentionBlocks | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface signature. query [B, nh, T, hd]; key/value [B, nkv, S, hd];
    attention_mask [B, 1, T, S] additive (0 or the dtype's minimum, from `eager_mask`).
    `attention_blocks`: a shared-prompt micro-batch's prompt and response blocks
    (shared_prompts.py), computed in place of the masked rows. Returns ([B, T, nh, hd], None)."""
    if dropout > 0 or kwargs.get("s_aux") is not None or kwargs.get("softcap"):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if attention_blocks is not None:
        return _cascade(module, query, key, value, attention_blocks, scale), None
    return _attend(module, query, key, value, attention_mask, scale, **kwargs), None


def _attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, mask: torch.Tensor | None, scale: float,
            **kwargs) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V -> [B, T, nh, hd]; SDPA above `MAX_SCORES`."""
    batch, n_heads, q_len, head_dim = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    if batch * n_heads * q_len * kv_len > MAX_SCORES:
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scale,
                                      **kwargs)[0]
    # Heads h = j * groups + i share KV head j: adjacent, so a reshape folds them.
    q = query.reshape(batch, n_kv, n_heads // n_kv * q_len, head_dim)
    out = _GroupedSoftmaxAttention.apply(q, key, value, mask, scale)
    return out.view(batch, n_heads, q_len, head_dim).transpose(1, 2)


def _cascade(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, blocks: AttentionBlocks, scale: float) -> torch.Tensor:
    """The shared-prompt rows' attention as dense blocks: the prompts (the first Pm columns of
    every row) causally, and each block of responses against their prompts' keys and their
    own. The same softmax over the same allowed keys as the masked rows: a response's keys
    are its prompt's and its own either way. -> [G, T, nh, hd]"""
    rows, n_heads, width, head_dim = query.shape
    prompt_width = blocks.prompt_mask.shape[-1]
    prompt = [x[:, :, :prompt_width] for x in (query, key, value)]
    # Gathers by index_select: its backward adds with index_add, several times faster on CPU
    # than the accumulating index_put that advanced indexing's backward runs.
    flat = [x.transpose(1, 2).reshape(rows * width, x.shape[1], head_dim)
            for x in (query, key, value)]

    def gather(x: torch.Tensor, block: ResponseBlock) -> torch.Tensor:   # -> [Rb, h, Lb, hd]
        picked = x.index_select(0, block.columns)
        return picked.view(len(block.rows), -1, x.shape[1], head_dim).transpose(1, 2)

    outs = [_attend(module, *prompt, blocks.prompt_mask, scale)]
    for block in blocks.responses:
        keys, values = (torch.cat([p.index_select(0, block.rows), gather(f, block)], 2)
                        for p, f in zip(prompt[1:], flat[1:], strict=True))
        outs.append(_attend(module, gather(flat[0], block), keys, values, block.mask, scale))
    out = torch.cat([*(o.reshape(-1, n_heads, head_dim) for o in outs),
                     outs[0].new_zeros(1, n_heads, head_dim)])
    return out.index_select(0, blocks.output_index).view(rows, width, n_heads, head_dim)


def _scores(q: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """Q K^T * scale + mask in float32 (float64 for a float64 model): [B, nkv, g*T, S] (mask
    [B, 1, T, S], additive, the same for the g query heads of a KV head)."""
    scores = torch.matmul(q, key.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(scale)
    if mask is not None:
        batch, n_kv, rows, kv_len = scores.shape
        q_len = mask.shape[-2]
        scores.view(batch, n_kv, rows // q_len, q_len, kv_len).add_(mask[:, :, None])
    return scores


class _GroupedSoftmaxAttention(torch.autograd.Function):
    """out = softmax(Q K^T * scale + mask) V on folded heads: q [B, nkv, g*T, hd], key/value
    [B, nkv, S, hd], mask [B, 1, T, S] additive or None. The softmax runs in float32 (or
    float64), the two matmuls in the compute dtype (autocast's, or the inputs').

    Backward, with P the probabilities recomputed from the saved Q, K and mask:
        dV = P^T dO;   dP = dO V^T;   dS = P * (dP - rowsum(P * dP));
        dQ = dS K * scale;   dK = dS^T Q * scale."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        dtype = matmul_dtype(q)
        with torch.autocast(q.device.type, enabled=False):
            qc, kc, vc = q.to(dtype), key.to(dtype), value.to(dtype)
            probs = torch.softmax(_scores(qc, kc, mask, scale), -1)
            out = torch.matmul(probs.to(dtype), vc)
        ctx.save_for_backward(qc, kc, vc, mask)
        ctx.scale, ctx.dtypes = scale, (q.dtype, key.dtype, value.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: torch.Tensor):
        q, key, value, mask = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dtype = q.dtype
            # softmax's own kernel, not exp(scores - max) / sum from saved statistics: the
            # masked scores (the dtype's minimum) and far-below-max ones send a plain exp down
            # a slow path (zeros and denormals), 6-20x slower on CPU.
            probs = torch.softmax(_scores(q, key, mask, ctx.scale), -1)
            d_out = d_out.to(dtype)
            d_value = torch.matmul(probs.to(dtype).transpose(-1, -2), d_out)
            d_probs = torch.matmul(d_out, value.transpose(-1, -2)).to(probs.dtype)
            d_scores = d_probs.sub_((probs * d_probs).sum(-1, keepdim=True)).mul_(probs)
            d_scores = d_scores.mul_(ctx.scale).to(dtype)
            d_q = torch.matmul(d_scores, key)
            d_key = torch.matmul(d_scores.transpose(-1, -2), q)
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return d_q.to(q_dtype), d_key.to(k_dtype), d_value.to(v_dtype), None, None


AttentionInterface.register(NAME, grouped_attention)
# The additive float mask (0 / dtype min) of HF's eager path: padding query rows then softmax
# over all-minimum scores (finite, ignored) instead of NaN.
AttentionMaskInterface.register(NAME, eager_mask)


def resolve_attn_implementation(choice: str, device: torch.device | str) -> str:
    """`auto` -> `dagrl_grouped` on the host CPU, `sdpa` on accelerators (whose fused kernels
    are fast there); other choices pass through."""
    if choice not in CHOICES:
        raise ValueError(f"model.attn_implementation: {choice!r} is not one of {CHOICES}")
    if choice != "auto":
        return choice
    return NAME if is_host(device) else "sdpa"
