"""A fast decoder for HF Llama / Qwen2-layout causal LMs: a hand-written forward pass over the
model's own weight tensors, a preallocated KV cache, and compaction of finished sequences.

Why it is faster than calling the HF model once per step:
- no per-step module dispatch, mask building, cache bookkeeping or output dataclasses: one
  decode step is ~25 tensor ops per layer;
- q/k/v and gate/up are one matmul each over fused tensors that are the modules' own storage
  (`_fuse`), so `update_weights` updates them in place and no second copy of the weights exists;
- decode steps keep activations feature-major and multiply W @ x^T, the operand order MKL runs
  faster for few rows (`project`; the ops are rollout/native_ops.py);
- the prefill packs the real prompt tokens (no compute on padding), computes rows that share a
  prompt once, uses matmul-softmax attention for short prompts and only computes logits at each
  row's last prompt token;
- a sequence that emitted a stop token leaves the active batch (with its KV-cache rows).

Sampling is `sample_next_token` on the active rows, keyed by each row's own `sample_seed` and
decode position, so a sequence's tokens do not depend on which batch it is decoded in.
Only exactly supported configurations take this path (`fast_path_unsupported` says why not);
`rollout.backend=auto` uses the HF backend otherwise. The measurements behind each choice are
in docs/performance.md, "Native decoder: design choices and their measurements".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dagrl.rollout.native_ops import (
    DecodeAttention,
    PrefillAttention,
    head_logits,
    is_feature_major,
    project,
    rms_norm,
    rope,
    to_step_layout,
)
from dagrl.rollout.sampling import (
    SamplingParams,
    logprob_temperature,
    sample_next_token,
    uniform_draws,
)

if TYPE_CHECKING:   # transformers loads in seconds: not when only a config is checked
    from transformers import PreTrainedModel

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
    for layer in model.model.layers:
        for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                      (layer.mlp.gate_proj, layer.mlp.up_proj)):
            if len({m.bias is None for m in group}) > 1:
                return "projections that share an input with a bias on some but not all"
    return None


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = model.model.layers
    return [model.lm_head] + [m for layer in layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]


def _shares_storage(linears: Sequence[torch.nn.Linear], fused: torch.Tensor) -> bool:
    return all(m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
               for m in linears)


@torch.inference_mode(False)   # ordinary tensors, even when called while decoding: they become
@torch.no_grad()               # the modules' parameters, which a shared actor trains
def _fuse(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the weights (and biases) of projections that read the same input into one tensor
    and make each module's parameter a view of its rows: [sum N_i, K] (and [sum N_i]).

    One matmul instead of several per step, with no second copy of the weights: updates to
    the modules' parameters (`ModelCopy.update_weights` copies in place) land in the fused
    tensor. The projections have a bias all or none (`fast_path_unsupported`).
    """
    def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
        fused, start = torch.cat(tensors), 0
        for t in tensors:
            t.data = fused[start:start + t.shape[0]]
            start += t.shape[0]
        return fused

    weight = stack([m.weight for m in linears])
    return weight, None if linears[0].bias is None else stack([m.bias for m in linears])


@dataclass
class _LayerWeights:
    in_norm: torch.Tensor             # [H]  sqrt(H) times the norm weight (see `rms_norm`)
    qkv: torch.Tensor                 # [(nh + 2 nkv) * hd, H]  q, k, v projections stacked
    qkv_bias: torch.Tensor | None
    o: torch.Tensor                   # [H, nh * hd]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor           # [H]  likewise
    gate_up: torch.Tensor             # [2 I, H]  gate, up stacked
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor                # [H, I]
    down_bias: torch.Tensor | None


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
        self.h_eps: torch.Tensor | None = None   # H * eps, 0-dim, made by `_weights`
        self._fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _weights(self) -> tuple[list[_LayerWeights], torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-layer weights, embedding [V, H], final norm [H], lm_head [V, H]); norm weights
        are scaled by sqrt(H) for `rms_norm`.

        The fused q/k/v and gate/up tensors are the modules' own storage (see `_fuse`), made
        once; they are made again only if a parameter was replaced (not updated in place)."""
        m = self.model.model
        hidden = m.embed_tokens.weight.shape[1]
        root_h = hidden ** 0.5                              # norms take sqrt(H) w (`rms_norm`)
        self.h_eps = torch.tensor(hidden * self.eps, dtype=m.embed_tokens.weight.dtype,
                                  device=m.embed_tokens.weight.device)
        layers = []
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, linears in (("qkv", (attn.q_proj, attn.k_proj, attn.v_proj)),
                                  ("gate_up", (mlp.gate_proj, mlp.up_proj))):
                fused = self._fused.get((i, name))
                if fused is None or not _shares_storage(linears, fused[0]):
                    self._fused[i, name] = _fuse(linears)
            qkv, qkv_bias = self._fused[i, "qkv"]
            gate_up, gate_up_bias = self._fused[i, "gate_up"]
            layers.append(_LayerWeights(
                in_norm=layer.input_layernorm.weight * root_h, qkv=qkv, qkv_bias=qkv_bias,
                o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                post_norm=layer.post_attention_layernorm.weight * root_h,
                gate_up=gate_up, gate_up_bias=gate_up_bias,
                down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias))
        return layers, m.embed_tokens.weight, m.norm.weight * root_h, self.model.lm_head.weight

    def _rope_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [length, hd] for positions 0..length-1 (see `rope`), computed as
        HF's rotary embedding does (position * inv_freq in float32), so the values match it."""
        inv_freq = self.model.model.rotary_emb.inv_freq.to(device=device, dtype=torch.float32)
        freqs = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]
        dtype = self.model.dtype
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return cos.to(dtype), signed_sin.to(dtype)

    def _embed(self, ids: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Token embeddings [M, H], feature-major when M is a decode-sized step (see `project`)."""
        x = F.embedding(ids, embed)
        return to_step_layout(x)

    def _logits(self, x: torch.Tensor, final_norm: torch.Tensor,
                lm_head: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states [A, H] -> float32 logits [A, V], row-major (the
        sampler reduces over the vocabulary)."""
        return head_logits(rms_norm(x, final_norm, self.h_eps), lm_head).float()

    def _forward(self, layers: list[_LayerWeights], x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 attend: PrefillAttention | DecodeAttention) -> torch.Tensor:
        """Run the decoder layers on M new tokens and write their keys/values into the cache.

        x: [M, H] (feature-major in decode steps, see `project`); cos/sin: [M, hd];
        k_cache: [L, A, nkv, hd, S] (transposed), v_cache: [L, A, nkv, S, hd]. Returns the
        final hidden states [M, H] (before the last norm).
        """
        tokens = x.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        cos, sin = cos[:, None], sin[:, None]                          # [M, 1, hd]
        for i, w in enumerate(layers):
            h = rms_norm(x, w.in_norm, self.h_eps)
            qkv = project(h, w.qkv, w.qkv_bias).view(tokens, nh + 2 * nkv, hd)
            qk = rope(qkv[:, :nh + nkv], cos, sin)      # q and k heads rotated in one go
            att = attend(qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:], k_cache[i], v_cache[i])
            x = x + project(att, w.o, w.o_bias)
            h = rms_norm(x, w.post_norm, self.h_eps)
            gate, up = project(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # [M, I] each
            x = x + project(F.silu(gate) * up, w.down, w.down_bias)
        return x

    def _prefill(self, layers: list[_LayerWeights], embed: torch.Tensor, final_norm: torch.Tensor,
                 lm_head: torch.Tensor, prompt_ids: torch.Tensor, valid: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor, length: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the prompts (left-padded [B, P], `valid` their mask) through the model and fill a
        fresh KV cache of `length` columns. Returns (k_cache [L, B, nkv, hd, length] (keys are
        cached transposed, see `DecodeAttention`), v_cache [L, B, nkv, length, hd], the logits
        of each row's next token [B, V]).

        Rows holding the same prompt (GRPO's n samples of a prompt) are computed once and their
        cache rows and logits copied: an 8-prompts x 8-samples batch prefills 8 rows, not 64.
        A row's prefill does not depend on the other rows, so only float rounding can differ
        (the matmuls see fewer rows); the measured difference is in docs/performance.md.
        """
        device = prompt_ids.device
        # One row per distinct prompt; padding is -1 in the key so it compares equal.
        distinct, inverse = torch.unique(prompt_ids.masked_fill(~valid, -1), dim=0,
                                         return_inverse=True)
        shared = distinct.shape[0] < prompt_ids.shape[0]
        if shared:
            valid = distinct >= 0
            prompt_ids = distinct.clamp(min=0)
        rows, P = prompt_ids.shape
        # Zeros, not empty: prompt padding columns are never written, and a masked score must
        # not be NaN (-inf + NaN stays NaN through the softmax).
        k_cache = torch.zeros(len(layers), rows, self.n_kv, self.head_dim, length,
                              dtype=embed.dtype, device=device)           # [L, rows, nkv, hd, S]
        v_cache = torch.zeros(len(layers), rows, self.n_kv, length, self.head_dim,
                              dtype=embed.dtype, device=device)           # [L, rows, nkv, S, hd]
        # The real prompt tokens packed, row-major (token m = row[m], column col[m]).
        row, col = valid.nonzero(as_tuple=True)                            # [M] each
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        allowed = (causal & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)
        prefill_bias = torch.zeros(allowed.shape, dtype=embed.dtype, device=device).masked_fill(
            ~allowed, float("-inf"))                                       # [rows, P, P]
        prompt_pos = (valid.long().cumsum(-1) - 1)[row, col]
        x = self._forward(layers, self._embed(prompt_ids[row, col], embed), cos_table[prompt_pos],
                          sin_table[prompt_pos], k_cache, v_cache,
                          PrefillAttention(row, col, prefill_bias[:, None]))        # [M, H]
        last = valid.sum(-1).cumsum(0) - 1           # each row's last prompt token (column P-1)
        logits = self._logits(x[last], final_norm, lm_head)                # [rows, V]
        if shared:
            k_cache, v_cache, logits = k_cache[:, inverse], v_cache[:, inverse], logits[inverse]
        return k_cache, v_cache, logits

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample one response per row, as `RolloutEngine.generate` specifies (see `_generate`).

        Decoding runs under `torch.inference_mode`, which skips autograd's per-op bookkeeping
        (version counters, view tracking; see docs/performance.md). Its tensors may not enter
        autograd later (the response mask multiplies the loss), so the three [B, R] results are
        handed back as ordinary copies.
        """
        with torch.inference_mode():
            out = self._generate(prompt_ids, prompt_mask, sample_seed, params,
                                 max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                 stop_token_ids=stop_token_ids, pad_token_id=pad_token_id)
        return tuple(t.clone() for t in out)

    def _key_bias(self, valid: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """key_bias[b, j, s]: 0 where column s may be attended to, -inf for prompt padding; the
        same for each of the nkv KV heads j, so a decode step slices it as [A*nkv, 1, c].
        valid: [B, P] -> [B, nkv, length]."""
        batch, prompt_len = valid.shape
        key_bias = torch.zeros(batch, length, dtype=dtype, device=valid.device)
        key_bias[:, :prompt_len].masked_fill_(~valid, float("-inf"))
        return key_bias[:, None].repeat(1, self.n_kv, 1)

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
        logprobs = torch.zeros(batch, R, device=device)
        if batch == 0 or R == 0:
            return responses, torch.zeros(batch, R, device=device), logprobs

        prompt_ids, valid = _trim_prompts(prompt_ids, prompt_mask)
        P = prompt_ids.shape[1]
        cos_table, sin_table = self._rope_tables(P + R, device)          # [P+R, hd]

        layers, embed, final_norm, lm_head = self._weights()
        k_cache, v_cache, logits = self._prefill(layers, embed, final_norm, lm_head, prompt_ids,
                                                 valid, cos_table, sin_table, P + R)
        key_bias = self._key_bias(valid, P + R, embed.dtype)               # [B, nkv, P+R]
        step_cos, step_sin = _step_tables(valid, cos_table, sin_table, R)  # [R, hd, B] each

        # The active batch: rows still decoding, as indices into the output rows (`None` while
        # it is every row: plain column writes then, not scatters).
        rows = None
        length = torch.full((batch,), R, dtype=torch.long, device=device)   # tokens per row
        temperature = logprob_temperature(params.temperature)
        # Every row's uniform draw for every position at once: [B, R] float64.
        draws = None if params.greedy else uniform_draws(sample_seed, 0, R)
        for t in range(R):
            may_stop = t >= min_new_tokens
            allowed = logits if may_stop else logits.index_fill(1, stop, float("-inf"))
            u = None if draws is None else draws[:, t] if rows is None else draws[rows, t]
            token = sample_next_token(allowed, params, sample_seed, t, u)        # [A]
            # The log-prob under the model's own distribution (not the EOS-masked one): the
            # quantity the actor recomputes. One fused log_softmax over [A, V]: fewer ops than
            # logsumexp for the small per-step tensors.
            scaled = logits if temperature == 1.0 else logits / temperature
            logp = scaled.log_softmax(-1).gather(1, token[:, None])[:, 0]
            at = slice(None) if rows is None else rows
            responses[at, t] = token
            logprobs[at, t] = logp
            if t == R - 1:
                break
            done = torch.isin(token, stop) if may_stop else None
            if done is not None and bool(done.any()):
                rows = torch.arange(batch, device=device) if rows is None else rows
                length[rows[done]] = t + 1
                keep = ~done
                rows, token = rows[keep], token[keep]
                if rows.numel() == 0:
                    break
                # Columns 0..P+t-1 hold keys and values so far; column P+t is written next.
                k_cache = _drop_rows(k_cache, keep, written=P + t, column_dim=4)
                v_cache = _drop_rows(v_cache, keep, written=P + t, column_dim=3)
                key_bias = key_bias[keep]
            col = P + t
            cos, sin = ((step_cos[t], step_sin[t]) if rows is None else
                        (step_cos[t][:, rows], step_sin[t][:, rows]))          # [hd, A]
            cos, sin = cos.t(), sin.t()                                        # [A, hd]
            x = self._embed(token, embed)
            if not is_feature_major(x):  # the tables in the same layout as x (see `rope`)
                cos, sin = cos.contiguous(), sin.contiguous()
            x = self._forward(layers, x, cos, sin, k_cache, v_cache,
                              DecodeAttention(col, key_bias[:, :, :col + 1].flatten(0, 1)[:, None]))
            logits = self._logits(x, final_norm, lm_head)
        response_mask = (torch.arange(R, device=device) < length[:, None]).float()
        return responses, response_mask, logprobs


def _drop_rows(cache: torch.Tensor, keep: torch.Tensor, written: int,
               column_dim: int) -> torch.Tensor:
    """The KV cache [L, A, ...] without the rows where `keep` is False: the kept rows moved to
    the front of the same storage, returned as a view [L, A', ...].

    Why not `cache[:, keep]`: that copies every kept row's every column into a fresh
    cache-sized block (whose pages the kernel then faults in), each time a sequence ends. Rows
    before the first finished one are already in place, and only the `written` columns hold
    anything yet, so only those are moved. The values are the same either way."""
    first = int((~keep).nonzero()[0])                     # rows before it stay where they are
    kept = keep.nonzero().flatten()
    filled = cache.narrow(column_dim, 0, written)
    filled[:, first:kept.numel()] = filled[:, kept[first:]]   # gathered first, then written
    return cache[:, :kept.numel()]


def _trim_prompts(prompt_ids: torch.Tensor,
                  prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check that every row is left-padded (ends in a real token) and drop the columns that are
    padding in every row (they change nothing): [B, P] -> ([B, P'], valid [B, P'] bool)."""
    valid = prompt_mask.bool()
    if not bool(valid[:, -1].all()):
        bad = (~valid[:, -1]).nonzero().flatten().tolist()[:5]
        raise ValueError(f"FastDecoder: prompt rows {bad} do not end in a real token; prompts "
                         "must be left-padded and hold at least one token")
    first = int(valid.any(0).float().argmax())
    return prompt_ids[:, first:], valid[:, first:]


def _step_tables(valid: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's RoPE rows for every decode step (positions continue the prompt), stored
    [steps, hd, B]: step t's [A, hd] table is the transpose of a [hd, A] slice, which is the
    decoder's feature-major layout (see `rope`) with no copy while no row has finished."""
    step_pos = valid.sum(-1, keepdim=True) + torch.arange(steps, device=valid.device)  # [B, R]
    return (cos_table[step_pos].permute(1, 2, 0).contiguous(),
            sin_table[step_pos].permute(1, 2, 0).contiguous())
