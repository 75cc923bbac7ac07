"""A fast decoder for HF Llama / Qwen2-layout causal LMs: a hand-written forward pass over the
model's own weight tensors, a preallocated KV cache, and compaction of finished sequences.

Why it is faster than calling the HF model once per step:
- no per-step module dispatch, mask building, cache bookkeeping or output dataclasses: one
  decode step is ~10 tensor ops per layer;
- q/k/v and gate/up projections are fused into one matmul each (the fused copies are built at
  the start of every `generate` call, so a `load_weights` in between is always seen);
- the prefill only computes logits at the last prompt column, and skips prompt columns that
  are padding for every row;
- a sequence that emitted EOS is dropped from the active batch (and its KV-cache rows with it),
  so it costs no compute for the rest of the call.

Sampling is `sample_next_token` on the active rows, keyed by each row's own `sample_seed` and
decode position, so a sequence's tokens do not depend on which batch it is decoded in.

Only exactly supported configurations take this path (`fast_path_unsupported` says why not);
`Generator` falls back to the HF forward otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dagrl.algorithms.utils import logprobs_from_logits
from dagrl.engines.sampling import SamplingParams, gumbel_block, sample_next_token

# Sampling noise drawn at once: [rows, positions, vocab] float32 elements (16 MiB).
NOISE_BLOCK_ELEMENTS = 2**22

SUPPORTED_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def fast_path_unsupported(model: torch.nn.Module) -> str | None:
    """None if `FastDecoder` reproduces `model` exactly, else the reason it cannot."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if SUPPORTED_CLASSES.get(name) is None or config is None:
        return f"model class {name} is not one of {sorted(SUPPORTED_CLASSES)}"
    if config.model_type != SUPPORTED_CLASSES[name]:
        return f"model_type {config.model_type!r} does not match {name}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        return f"rope parameters {rope!r} (only default RoPE is implemented)"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return f"layer types {sorted(set(config.layer_types))} (only full attention)"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if getattr(model.config, "quantization_config", None) is not None and \
            not all(isinstance(m, torch.nn.Linear) and m.weight.is_floating_point()
                    for m in _linears(model)):
        return "quantized linear layers"
    if getattr(model.model.rotary_emb, "attention_scaling", 1.0) != 1.0:
        return "scaled RoPE attention"
    return None


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = model.model.layers
    return [model.lm_head] + [m for layer in layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The fused bias of several projections (zeros for those without one), or None if none has."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                      for m in linears])


@dataclass
class _LayerWeights:
    in_norm: torch.Tensor             # [H]
    qkv: torch.Tensor                 # [(nh + 2 nkv) * hd, H]  q, k, v projections stacked
    qkv_bias: torch.Tensor | None
    o: torch.Tensor                   # [H, nh * hd]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor           # [H]
    gate_up: torch.Tensor             # [2 I, H]  gate, up stacked
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor                # [H, I]
    down_bias: torch.Tensor | None


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention) in 4 ops: x [..., hd], cos/signed_sin broadcastable.

    HF's rotate_half(x) * sin = cat(-x2, x1) * sin = roll(x, hd/2) * cat(-sin1, sin2): the sign
    moves into the table (exact in floating point), saving the negation and the concatenation.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class FastDecoder:
    """Decodes a supported HF causal LM (see `fast_path_unsupported`) without its modules."""

    def __init__(self, model: PreTrainedModel) -> None:
        reason = fast_path_unsupported(model)
        if reason is not None:
            raise ValueError(f"FastDecoder cannot run this model: {reason}")
        self.model = model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps

    def _weights(self) -> tuple[list[_LayerWeights], torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-layer weights, embedding [V, H], final norm [H], lm_head [V, H]) read from the
        model now, so in-place weight updates since the last call are picked up."""
        m = self.model.model
        layers = []
        for layer in m.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(_LayerWeights(
                in_norm=layer.input_layernorm.weight,
                qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias))
        return layers, m.embed_tokens.weight, m.norm.weight, self.model.lm_head.weight

    def _rope_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [length, hd] for positions 0..length-1 (see `_rope`), computed as
        HF's rotary embedding does (position * inv_freq in float32), so the values match it."""
        inv_freq = self.model.model.rotary_emb.inv_freq.to(device=device, dtype=torch.float32)
        freqs = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]
        dtype = self.model.dtype
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return cos.to(dtype), signed_sin.to(dtype)

    def _forward(self, layers: list[_LayerWeights], x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                 attn_mask: torch.Tensor) -> torch.Tensor:
        """Run the decoder layers on T new columns and append their keys/values to the cache.

        x: [A, T, H]; cos/sin: [A, T, hd]; k_cache/v_cache: [L, A, nkv, S, hd], written at
        columns start..start+T-1; attn_mask: [A, 1, T, start+T] additive (0 or -inf).
        Returns the final hidden states [A, T, H] (before the last norm).
        """
        rows, cols, hidden = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        end = start + cols
        cos, sin = cos[:, None], sin[:, None]                          # [A, 1, T, hd]
        for i, w in enumerate(layers):
            h = F.rms_norm(x, (hidden,), w.in_norm, self.eps)
            qkv = F.linear(h, w.qkv, w.qkv_bias)                       # [A, T, (nh+2nkv)*hd]
            qkv = qkv.view(rows, cols, nh + 2 * nkv, hd).transpose(1, 2)  # [A, heads, T, hd]
            qk = _rope(qkv[:, :nh + nkv], cos, sin)      # q and k heads rotated in one go
            q = qk[:, :nh]
            k_cache[i, :, :, start:end] = qk[:, nh:]
            v_cache[i, :, :, start:end] = qkv[:, nh + nkv:]
            keys, values = k_cache[i, :, :, :end], v_cache[i, :, :, :end]  # [A, nkv, end, hd]
            if cols == 1:
                # Decode: fold the query heads that share a KV head into one axis,
                # [A, nh, 1, hd] -> [A, nkv, nh/nkv, hd], so GQA needs no copy of the cache.
                # Plain matmul-softmax-matmul: for a one-token query SDPA's CPU kernel costs
                # more per call than the math (measured: ~40% of a tiny-model decode step).
                scores = torch.matmul(q.reshape(rows, nkv, nh // nkv, hd), keys.transpose(-1, -2))
                scores = scores.mul_(hd ** -0.5).add_(attn_mask)        # [A, nkv, nh/nkv, end]
                att = torch.matmul(scores.softmax(-1), values).reshape(rows, 1, nh * hd)
            else:
                att = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask,
                                                     enable_gqa=nh != nkv)  # [A, nh, T, hd]
                att = att.transpose(1, 2).reshape(rows, cols, nh * hd)
            x = x + F.linear(att, w.o, w.o_bias)
            h = F.rms_norm(x, (hidden,), w.post_norm, self.eps)
            gate, up = F.linear(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # [A, T, I] each
            x = x + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        return x

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample one response per row, as `Generator.generate` specifies (see `_generate`).

        Decoding runs under `torch.inference_mode`, which skips autograd's per-op bookkeeping
        (version counters, view tracking): 16% of a tiny-model decode. Its tensors may not
        enter autograd later (the response mask multiplies the loss), so the three [B, R]
        results are handed back as ordinary copies.
        """
        with torch.inference_mode():
            out = self._generate(prompt_ids, prompt_mask, sample_seed, params,
                                 max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                 stop_token_ids=stop_token_ids, pad_token_id=pad_token_id)
        return tuple(t.clone() for t in out)

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                  min_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample one response per row.

        prompt_ids/prompt_mask: [B, P] left-padded; sample_seed: [B]; a sequence ends at the
        first of `stop_token_ids` it emits (EOS and any other stop tokens).
        Returns (responses [B, R] int64, response_mask [B, R] float32, logprobs [B, R] float32).
        """
        device = prompt_ids.device
        stop = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=device)
        batch, R = prompt_ids.shape[0], max_new_tokens
        responses = torch.full((batch, R), pad_token_id, dtype=torch.long, device=device)
        response_mask = torch.zeros(batch, R, device=device)
        logprobs = torch.zeros(batch, R, device=device)
        if batch == 0 or R == 0:
            return responses, response_mask, logprobs

        # Drop the prompt columns that are padding in every row: they change nothing.
        valid = prompt_mask.bool()
        first = int(valid.any(0).float().argmax()) if valid.any() else valid.shape[1] - 1
        prompt_ids, valid = prompt_ids[:, first:], valid[:, first:]
        P = prompt_ids.shape[1]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)            # [B, P]
        cos_table, sin_table = self._rope_tables(P + R, device)          # [P+R, hd]

        layers, embed, final_norm, lm_head = self._weights()
        cache_shape = (len(layers), batch, self.n_kv, P + R, self.head_dim)
        k_cache = torch.empty(cache_shape, dtype=embed.dtype, device=device)
        v_cache = torch.empty(cache_shape, dtype=embed.dtype, device=device)
        # key_bias[b, s]: 0 where column s may be attended to, -inf for prompt padding.
        key_bias = torch.zeros(batch, P + R, dtype=embed.dtype, device=device)
        key_bias[:, :P].masked_fill_(~valid, float("-inf"))            # [B, P+R]

        # Prefill: causal attention over real prompt tokens. Pad query rows also attend to
        # themselves so no softmax row is empty (an all-masked row gives NaN; pad rows' outputs
        # are never used).
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        allowed = (causal & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)
        prefill_bias = torch.zeros(allowed.shape, dtype=embed.dtype, device=device).masked_fill(
            ~allowed, float("-inf"))                                       # [B, P, P]
        x = self._forward(layers, F.embedding(prompt_ids, embed), cos_table[positions],
                          sin_table[positions], k_cache, v_cache, 0, prefill_bias[:, None])
        logits = F.linear(F.rms_norm(x[:, -1], (x.shape[-1],), final_norm, self.eps),
                          lm_head).float()                                  # [B, V]

        # The active batch: rows still decoding, as indices into the output rows (`None` while
        # it is every row: plain column writes then, not scatters).
        rows = None
        pos = positions[:, -1] + 1                                      # next position [A]
        temperature = params.temperature if params.temperature > 0 else 1.0
        # Sampling noise for a block of positions at a time, for every row (bounded memory).
        block = max(1, min(R, NOISE_BLOCK_ELEMENTS // max(1, batch * lm_head.shape[0])))
        noise = None
        for t in range(R):
            may_stop = t >= min_new_tokens
            allowed = logits if may_stop else logits.index_fill(1, stop, float("-inf"))
            gumbel = None
            if not params.greedy:
                if t % block == 0:
                    noise = gumbel_block(sample_seed, t, min(block, R - t), lm_head.shape[0])
                gumbel = noise[:, t % block] if rows is None else noise[rows, t % block]
            # The noise already carries each row's seed and position: `sample_seed` is unused here.
            token = sample_next_token(allowed, params, sample_seed, t, gumbel)   # [A]
            # The log-prob under the model's own distribution (not the EOS-masked one): the
            # quantity the actor recomputes.
            logp = logprobs_from_logits(logits if temperature == 1.0 else logits / temperature,
                                        token)
            at = slice(None) if rows is None else rows
            responses[at, t] = token
            logprobs[at, t] = logp
            response_mask[at, t] = 1.0
            if t == R - 1:
                break
            done = torch.isin(token, stop) if may_stop else None
            if done is not None and bool(done.any()):
                keep = ~done
                rows = torch.arange(batch, device=device) if rows is None else rows
                rows, token, pos = rows[keep], token[keep], pos[keep]
                if rows.numel() == 0:
                    break
                k_cache, v_cache = k_cache[:, keep], v_cache[:, keep]
                key_bias = key_bias[keep]
            col = P + t
            x = self._forward(layers, F.embedding(token[:, None], embed), cos_table[pos][:, None],
                              sin_table[pos][:, None], k_cache, v_cache, col,
                              key_bias[:, None, None, :col + 1])
            logits = F.linear(F.rms_norm(x[:, 0], (x.shape[-1],), final_norm, self.eps),
                              lm_head).float()
            pos = pos + 1
        return responses, response_mask, logprobs
