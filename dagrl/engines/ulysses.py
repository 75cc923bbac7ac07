"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as in verl): the sp ranks of a replica each
run the model on 1/sp of every sequence, and swap sequence shards for head shards around
attention with two all-to-alls:

    q, k, v   [B, h, T/sp, d]  --all-to-all-->  [B, h/sp, T, d]   whole sequence, 1/sp of heads
    causal attention on the whole sequence (on each of a row's sequences)
    output    [B, h/sp, T, d]  --all-to-all-->  [B, h, T/sp, d]

Everything else (embeddings, norms, MLP, LM head) is per token, so a rank's activations are
those of T/sp tokens. KV heads fewer than sp are repeated to sp first (each rank then gets the
one its query heads read). The attention, registered here as transformers' `dagrl_ulysses`
attention, is PyTorch's SDPA with is_causal (whatever kernel the model was configured with:
the sequence-parallel path builds no mask for a kernel to read).

forward.py pads the [B, T] input to a multiple of sp, gives rank s the columns
[s T/sp, (s+1) T/sp) with their global position ids and, for padded or packed rows, the columns
of each sequence in the whole row (attention then runs causally on each, with no [T, T] mask),
and sums the per-token results over the sp group (`sum_rows`), each token being computed by
exactly one rank. That sum keeps each summand's whole gradient in backward, so each rank's
parameter gradient covers its own tokens; FSDP2, sharding over dp x sp, averages them, which
the actor's loss scaling (x dp*sp) turns back into the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from dagrl.engines.sharding import decoder_layers
from dagrl.engines.tensor_parallel import head_counts

NAME = "dagrl_ulysses"
_MESH_ATTR = "dagrl_sp_mesh"   # lora.ReferenceView forwards it under this name
# The model-call keyword that carries each row's sequences (SequenceShard.segments) down to
# ulysses_attention: transformers passes unknown keywords through to the attention function,
# and activation checkpointing replays them in the recompute.
SEGMENTS_KWARG = "dagrl_segments"


def check_sequence_parallel(config, sp: int, tp: int = 1,
                            key: str = "actor.sequence_parallel_size") -> None:
    """Raise ValueError naming `key` unless each tp rank's heads split over `sp` ranks."""
    if getattr(config, "vision_config", None) is not None:
        # a shard of a sequence would need its image tokens' 3-row M-RoPE positions, which
        # `shard_sequence` does not cut (data/vision.py computes them over whole rows)
        raise ValueError(f"{key}={sp}: an image-text model's M-RoPE positions are computed over "
                         "whole sequences only; use sequence_parallel_size=1")
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
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is not None:   # padded or packed rows: causal attention within each sequence
        out = _segment_attention(module, q, k, v, segments, **kwargs)   # [B, T, h/sp, d]
    else:   # whole, unpadded sequences: plain causal attention (SDPA's is_causal), no mask
        out, _ = sdpa_attention_forward(module, q, k, v, None, **kwargs)
    return _heads_to_seq(out.transpose(1, 2), group, sp).transpose(1, 2), None


def _segment_attention(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, segments: list[list[tuple[int, int]]],
                       **kwargs) -> torch.Tensor:
    """Causal SDPA on each sequence's columns [start, end) of each row, zeros elsewhere
    (padding: no caller reads it). q, k, v [B, h, T, d] -> [B, T, h, d]. Nothing of size
    [T, T] is built: the kernel's is_causal does the masking (a packed row of several
    sequences is several calls)."""
    _, heads, total, dim = q.shape
    rows = []
    for b, spans in enumerate(segments):
        pieces, at = [], 0
        for start, end in spans:
            if start > at:
                pieces.append(q.new_zeros(1, start - at, heads, dim))
            out, _ = sdpa_attention_forward(module, q[b:b + 1, :, start:end],
                                            k[b:b + 1, :, start:end], v[b:b + 1, :, start:end],
                                            None, **kwargs)                    # [1, L, h, d]
            pieces.append(out)
            at = end
        if at < total:
            pieces.append(q.new_zeros(1, total - at, heads, dim))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def _no_mask(*args, **kwargs) -> None:
    """HF builds no mask of its own for `dagrl_ulysses`: forward.py passes each sequence's
    columns (`SEGMENTS_KWARG`), or nothing for causal attention over unpadded sequences."""
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
    for layer in decoder_layers(model):
        attn = layer.self_attn
        attn.dagrl_sp_mesh = mesh
        attn.num_key_value_groups = local_heads // local_kv
    model.config._attn_implementation = NAME
    setattr(model, _MESH_ATTR, mesh)
    return model


@dataclass
class SequenceShard:
    """This rank's slice of a [B, T] input, T padded to a multiple of sp."""
    input_ids: torch.Tensor       # [B, T/sp]
    position_ids: torch.Tensor    # [B, T/sp], global positions
    # Per row, the [start, end) columns of each sequence in the whole (padded) row; None:
    # every row is one whole unpadded sequence (plain causal attention).
    segments: list[list[tuple[int, int]]] | None
    rows: torch.Tensor            # [n] flat indices into [B * T/sp]: the requested positions here
    order: torch.Tensor           # [n] their indices in the request

    def model_kwargs(self) -> dict:
        """Keywords for the model call besides input_ids."""
        kwargs = {"position_ids": self.position_ids, "attention_mask": None}
        if self.segments is not None:
            kwargs[SEGMENTS_KWARG] = self.segments
        return kwargs


def shard_sequence(mesh: DeviceMesh, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   valid: torch.Tensor, wanted: torch.Tensor) -> SequenceShard:
    """input_ids, position_ids, valid (real tokens) [B, T]; wanted [N] flat indices into
    [B * T] of the positions whose outputs the caller needs (in its order). Attention stays
    within a sequence: causal, real keys only, and packed sequences (position ids restarting
    at 0) apart, by running it on each sequence's columns (`segments`): no [T, T] mask is
    ever built, which for long sequences is most of the saving."""
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
    segments = None if plain else _segments(position_ids, valid)     # padding at the end:
    row, column = wanted // width, wanted % width                     # after every sequence
    here = (column >= rank * length) & (column < (rank + 1) * length)
    order = here.nonzero().flatten()
    cols = slice(rank * length, (rank + 1) * length)
    return SequenceShard(input_ids[:, cols], position_ids[:, cols], segments,
                         row[order] * length + column[order] - rank * length, order)


def _segments(position_ids: torch.Tensor, valid: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) columns of each sequence's real tokens: a sequence starts
    where its position ids restart at 0 (packed rows hold several). Each must be contiguous
    (left-padded prompt + right-padded response, or packed); a gap inside one is refused."""
    sequence = (position_ids == 0).long().cumsum(-1)                   # [B, T]
    out = []
    for b in range(valid.shape[0]):
        columns = valid[b].bool().nonzero().flatten()                  # real tokens of row b
        _, counts = torch.unique_consecutive(sequence[b, columns], return_counts=True)
        ends = counts.cumsum(0)
        spans = []
        for first, n in zip((ends - counts).tolist(), counts.tolist(), strict=True):
            start, end = int(columns[first]), int(columns[first + n - 1]) + 1
            if end - start != n:
                raise ValueError(f"sequence parallelism: row {b} has a sequence with gaps in its "
                                 f"attention mask (columns {start}..{end - 1}); it needs each "
                                 "sequence's tokens side by side")
            spans.append((start, end))
        out.append(spans)
    return out


def sum_rows(local: torch.Tensor, shard: SequenceShard, total: int,
             mesh: DeviceMesh) -> torch.Tensor:
    """This rank's [n, C] results placed at their request indices, summed over the sp group:
    [N, C], the same on every rank. Each summand keeps the whole gradient in backward."""
    out = local.new_zeros(total, *local.shape[1:]).index_copy(0, shard.order, local)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).full_tensor()
