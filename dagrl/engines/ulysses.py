"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as in verl): the sp ranks of a replica each
run the model on 1/sp of every sequence, and swap sequence shards for head shards around
attention with two all-to-alls:

    q, k, v   [B, h, T/sp, d]  --all-to-all-->  [B, h/sp, T, d]   whole sequence, 1/sp of heads
    attention on the whole sequence, with the mask of the whole sequence
    output    [B, h/sp, T, d]  --all-to-all-->  [B, h, T/sp, d]

Everything else (embeddings, norms, MLP, LM head) is per token, so a rank's activations are
those of T/sp tokens. KV heads fewer than sp are repeated to sp first (each rank then gets the
one its query heads read). The attention runs through the model's configured kernel
(`dagrl_grouped`, sdpa, eager), registered here as `dagrl_ulysses` around it.

forward.py pads the [B, T] input to a multiple of sp, gives rank s the columns
[s T/sp, (s+1) T/sp) with their global position ids, passes the whole sequence's additive mask
[B, 1, T, T] (causal, padding, and packed-sequence boundaries; HF uses a 4-D mask as given), and
sums the per-token results over the sp group (`sum_rows`), each token being computed by exactly
one rank. That sum keeps each summand's whole gradient in backward, so each rank's parameter
gradient covers its own tokens; FSDP2, sharding over dp x sp, averages them, which the actor's
loss scaling (x dp*sp) turns back into the sum.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dagrl.engines.sharding import decoder_layers
from dagrl.engines.tensor_parallel import head_counts

NAME = "dagrl_ulysses"
_MESH_ATTR = "dagrl_sp_mesh"


def check_sequence_parallel(config, sp: int, tp: int = 1,
                            key: str = "actor.sequence_parallel_size") -> None:
    """Raise ValueError naming `key` unless each tp rank's heads split over `sp` ranks."""
    heads, kv = head_counts(config)
    local_heads, local_kv = heads // tp, max(kv // tp, 1)
    if local_heads % sp:
        raise ValueError(f"{key}={sp} must divide the model's num_attention_heads ({heads})"
                         + (f" / tensor_parallel_size ({tp})" if tp > 1 else ""))
    if local_kv % sp and sp % local_kv:
        raise ValueError(f"{key}={sp} must divide the model's num_key_value_heads ({kv}) or be "
                         "a multiple of it (KV heads are then repeated)")
    if any(t == "sliding_attention" for t in getattr(config, "layer_types", None) or ()):
        raise ValueError(f"{key}={sp}: sliding-window attention layers are not supported")


def sequence_parallel_mesh(model: torch.nn.Module) -> DeviceMesh | None:
    """The sp mesh `model` was set up for, or None."""
    return getattr(model, _MESH_ATTR, None)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[sp, ...] chunk i to rank i; returns [sp, ...] chunk i from rank i. PyTorch's
    functional collective: autograd-aware (backward is the reverse all-to-all), contiguous
    row-major buffers; waited on at once (attention needs the result now), which also returns
    a plain tensor rather than an async wrapper."""
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))


def _seq_to_heads(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[B, h, L, d] (this rank's L = T/sp tokens, all heads) -> [B, h/sp, T, d]."""
    b, h, length, d = x.shape
    chunks = x.reshape(b, sp, h // sp, length, d).transpose(0, 1)        # [sp, B, h/sp, L, d]
    got = _all_to_all(chunks, group)                                    # [sp(tokens), ...]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * length, d)


def _heads_to_seq(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[B, h/sp, T, d] -> [B, h, T/sp, d] (the inverse of _seq_to_heads)."""
    b, h, total, d = x.shape
    chunks = x.reshape(b, h, sp, total // sp, d).permute(2, 0, 1, 3, 4)  # [sp(tokens), B, ...]
    got = _all_to_all(chunks, group)                                    # [sp(heads), ...]
    return got.transpose(0, 1).reshape(b, sp * h, total // sp, d)


def _inner_attention(module: torch.nn.Module, name: str):
    if name == "eager":   # not in the registry: each model module defines its own
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface signature. query [B, h, T/sp, d], key/value [B, kv, T/sp, d],
    attention_mask the whole sequence's [B, 1, T, T]. Returns ([B, T/sp, h, d], None)."""
    mesh = module.dagrl_sp_mesh
    group, sp = mesh.get_group(), mesh.size()
    kv = key.shape[1]
    if kv % sp:   # fewer KV heads than ranks: repeat each to sp / kv ranks
        key = key.repeat_interleave(sp // kv, dim=1)
        value = value.repeat_interleave(sp // kv, dim=1)
    q, k, v = (_seq_to_heads(t, group, sp) for t in (query, key, value))
    # No mask: plain causal attention over whole, unpadded sequences (SDPA's is_causal).
    inner = (_inner_attention(module, module.dagrl_inner_attention)
             if attention_mask is not None else sdpa_attention_forward)
    out, _ = inner(module, q, k, v, attention_mask, **kwargs)            # [B, T, h/sp, d]
    return _heads_to_seq(out.transpose(1, 2), group, sp).transpose(1, 2), None


def _no_mask(*args, **kwargs) -> None:
    """HF builds no mask of its own for `dagrl_ulysses`: forward.py passes the whole
    sequence's 4-D mask, or none for causal attention over unpadded sequences."""
    return None


AttentionInterface.register(NAME, ulysses_attention)
AttentionMaskInterface.register(NAME, _no_mask)


def ulysses_parallelize(model: torch.nn.Module, mesh: DeviceMesh, tp: int = 1
                        ) -> torch.nn.Module:
    """Run `model`'s attention through `ulysses_attention` over the 1-D sp `mesh` (in place;
    after tensor_parallelize when tp > 1)."""
    sp = mesh.size()
    check_sequence_parallel(model.config, sp, tp)
    heads, kv = head_counts(model.config)
    local_heads, local_kv = heads // tp // sp, max(max(kv // tp, 1) // sp, 1)
    inner = model.config._attn_implementation
    for layer in decoder_layers(model):
        attn = layer.self_attn
        attn.dagrl_sp_mesh = mesh
        attn.dagrl_inner_attention = inner
        attn.num_key_value_groups = local_heads // local_kv
    model.config._attn_implementation = NAME
    setattr(model, _MESH_ATTR, mesh)
    return model


@dataclass
class SequenceShard:
    """This rank's slice of a [B, T] input, T padded to a multiple of sp."""
    input_ids: torch.Tensor       # [B, T/sp]
    position_ids: torch.Tensor    # [B, T/sp], global positions
    mask: torch.Tensor | None     # [B, 1, T, T] additive, the whole sequence's; None: causal
    rows: torch.Tensor            # [n] flat indices into [B * T/sp]: the requested positions here
    order: torch.Tensor           # [n] their indices in the request


def shard_sequence(mesh: DeviceMesh, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   valid: torch.Tensor, wanted: torch.Tensor, dtype: torch.dtype
                   ) -> SequenceShard:
    """input_ids, position_ids, valid (real tokens) [B, T]; wanted [N] flat indices into
    [B * T] of the positions whose outputs the caller needs (in its order). Attention stays
    within a sequence: causal, real keys only, and packed sequences (position ids restarting
    at 0) apart. Whole sequences without padding need no mask (causal attention): then none
    is built, which for long sequences is most of the saving ([B, T, T] elements)."""
    sp, rank = mesh.size(), mesh.get_local_rank()
    batch, width = input_ids.shape
    plain = bool(valid.all()) and bool(
        (position_ids == torch.arange(width, device=position_ids.device)).all())
    pad = -width % sp
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        position_ids = torch.nn.functional.pad(position_ids, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
    total = width + pad
    length = total // sp
    mask = None if plain else _whole_mask(position_ids, valid, dtype)    # padding at the end:
    row, column = wanted // width, wanted % width                         # after every query
    here = (column >= rank * length) & (column < (rank + 1) * length)
    order = here.nonzero().flatten()
    cols = slice(rank * length, (rank + 1) * length)
    return SequenceShard(input_ids[:, cols], position_ids[:, cols],
                         mask[:, None] if mask is not None else None,
                         row[order] * length + column[order] - rank * length, order)


def _whole_mask(position_ids: torch.Tensor, valid: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """[B, T, T] additive mask (0 or the dtype's minimum, finite like HF's eager mask, so a
    padding query row softmaxes to a harmless uniform): causal, real keys, one sequence."""
    total = position_ids.shape[1]
    segment = (position_ids == 0).long().cumsum(-1)                      # [B, T]
    causal = torch.ones(total, total, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (causal[None] & valid.bool()[:, None, :]
               & (segment[:, :, None] == segment[:, None, :]))            # [B, T, T]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def sum_rows(local: torch.Tensor, shard: SequenceShard, total: int,
             mesh: DeviceMesh) -> torch.Tensor:
    """This rank's [n, C] results placed at their request indices, summed over the sp group:
    [N, C], the same on every rank. Each summand keeps the whole gradient in backward."""
    out = local.new_zeros(total, *local.shape[1:]).index_copy(0, shard.order, local)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).full_tensor()
