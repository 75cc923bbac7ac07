"""Teacher-forced passes over (prompt, response): log-probs for the actor, the reference and the
old-logprob pass (so all compute exactly the quantity the rollout sampled with), and values for
the critic."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from dagrl.data.batch import Batch, response_attention
from dagrl.data.positions import position_ids_from_mask
from dagrl.data.vision import (
    ImageInputs,
    batch_images,
    image_kwargs,
    rope_positions,
    unemittable_tokens,
)
from dagrl.engines.attention import NAME as GROUPED_ATTENTION
from dagrl.engines.head_stats import head_token_stats
from dagrl.engines.micro_batches import micro_batches
from dagrl.engines.shared_prompts import shared_prompt_inputs
from dagrl.engines.ulysses import SequenceShard, sequence_parallel_mesh, shard_sequence, sum_rows
from dagrl.engines.vocab_parallel import is_vocab_sharded, vocab_parallel_token_stats

# Rows of [tokens, vocab] logits computed at once by the head of a teacher-forced pass.
DEFAULT_CHUNK_TOKENS = 1024


@dataclass
class ResponseLogprobs:
    logprobs: torch.Tensor                       # [B, R]
    entropy: torch.Tensor | None = None          # [B, R]
    sum_pi_squared: torch.Tensor | None = None   # [B, R] = Σ_v softmax(z/T)_v²


def _trimmed_inputs(prompt_ids, prompt_mask, responses, attention_mask):
    """[prompt | response] without the columns that are padding in every row (the layout is
    fixed-width, so a batch of short prompts carries many): (input_ids, attention [B, T],
    P' = the kept prompt width, R' = the last attended response column + 1).
    `attention_mask` [B, R]: the response tokens the model reads (see `response_logprobs`)."""
    first = int(prompt_mask.any(0).float().argmax()) if prompt_mask.any() else prompt_mask.shape[1]
    last = int(attention_mask.any(0).nonzero().max()) + 1 if attention_mask.any() else 0
    p_ids, p_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    input_ids = torch.cat([p_ids, responses[:, :last]], dim=1)
    attention = torch.cat([p_mask, attention_mask[:, :last]], dim=1).long()
    return input_ids, attention, p_ids.shape[1], last


def _packed_inputs(prompt_ids, prompt_mask, responses, response_mask, attention_mask):
    """Every row's [prompt | response] tokens, padding removed, end to end in one row:
    (input_ids [1, T], position_ids [1, T] restarting at 0 for each sequence, predicting [N] =
    the column of the packed row that predicts each response token of `response_mask`, in
    row-major order). transformers reads a packed row from position ids that restart (with no
    attention mask): attention stays within each sequence (flash-attn varlen on CUDA, a
    block-causal mask with sdpa/eager), so each token sees exactly what it saw in the padded
    layout."""
    width = prompt_ids.shape[1]
    used = response_mask.bool()
    # What the attention masks leave out is padding; a multi-turn response's tool tokens stay.
    keep = torch.cat([prompt_mask.bool(), attention_mask.bool()], dim=1)          # [B, P+R]
    tokens = torch.cat([prompt_ids, responses], dim=1)
    column = keep.flatten().cumsum(0).view_as(keep) - 1         # packed column of each kept one
    positions = keep.long().cumsum(1) - 1                       # 0.. within each sequence
    predicting = column[:, width:][used] - 1                                      # [N]
    return tokens[keep][None], positions[keep][None], predicting


def _global_layout(prompt_ids, prompt_mask, responses, response_mask, attention_mask,
                   pack: bool):
    """The [B, T] input of either layout for sequence parallelism: (input_ids, position_ids,
    valid = real tokens, wanted [N] = flat indices into [B * T] of the positions predicting
    each used response token, row-major over the response mask). The model reads
    `attention_mask` (every response token, a multi-turn response's tool tokens included:
    each sequence stays one contiguous span, as ulysses' segments need) and the outputs are
    taken at `response_mask` (the policy's tokens, with gaps)."""
    if pack:
        input_ids, positions, predicting = _packed_inputs(prompt_ids, prompt_mask, responses,
                                                          response_mask, attention_mask)
        return input_ids, positions, torch.ones_like(input_ids, dtype=torch.bool), predicting
    input_ids, attention, prompt_len, last = _trimmed_inputs(prompt_ids, prompt_mask, responses,
                                                             attention_mask)
    rows, cols = response_mask[:, :last].bool().nonzero(as_tuple=True)
    wanted = rows * input_ids.shape[1] + prompt_len - 1 + cols
    return input_ids, position_ids_from_mask(attention), attention.bool(), wanted


def _sequence_shard(model: torch.nn.Module, mesh, prompt_ids, prompt_mask, responses,
                    response_mask, attention_mask, pack: bool) -> SequenceShard:
    layout = _global_layout(prompt_ids, prompt_mask, responses, response_mask, attention_mask,
                            pack)
    return shard_sequence(mesh, *layout)


def _shared_prompt_kwargs(model: torch.nn.Module, prompt_ids, prompt_mask, responses,
                          response_mask, attention_mask) -> tuple[dict, torch.Tensor]:
    """The model's inputs in the shared-prompt layout (shared_prompts.py) and the flat
    [G * T] indices of the positions predicting each used response token."""
    shared = shared_prompt_inputs(prompt_ids, prompt_mask, responses, response_mask,
                                  attention_mask)
    attn, dtype = model.config._attn_implementation, model.get_input_embeddings().weight.dtype
    kwargs = {"input_ids": shared.input_ids, "position_ids": shared.position_ids,
              "attention_mask": shared.attention_mask(attn, dtype)}
    blocks = shared.attention_blocks(dtype) if attn == GROUPED_ATTENTION else None
    if blocks is not None:   # transformers passes it through to the attention (attention.py)
        kwargs["attention_blocks"] = blocks
    return kwargs, shared.predicting


def _check_layout(model: torch.nn.Module, share_prompts: bool, images) -> None:
    if share_prompts and sequence_parallel_mesh(model) is not None:
        raise ValueError("model.share_prompts with sequence parallelism: a sequence shard "
                         "holds contiguous spans of one sequence, and a shared-prompt row "
                         "holds several; set model.share_prompts=false")
    if images is not None and share_prompts:
        raise ValueError("images with model.share_prompts: M-RoPE positions are computed "
                         "over padded rows only; set model.share_prompts=false")


def _response_outputs(model: torch.nn.Module, prompt_ids, prompt_mask, responses,
                      response_mask, attention_mask, pack: bool,
                      share_prompts: bool = False) -> torch.Tensor:
    """Run the model on [prompt | response] and return its outputs at the positions that
    *predict* each used response token: [N, ...] (row-major over the response mask)."""
    _check_layout(model, share_prompts, None)
    if share_prompts:
        kwargs, predicting = _shared_prompt_kwargs(model, prompt_ids, prompt_mask, responses,
                                                   response_mask, attention_mask)
        out = model(use_cache=False, **kwargs).logits
        return out.reshape(-1, *out.shape[2:])[predicting]
    mesh = sequence_parallel_mesh(model)
    if mesh is not None:   # this rank's 1/sp of every sequence (ulysses.py)
        shard = _sequence_shard(model, mesh, prompt_ids, prompt_mask, responses, response_mask,
                                attention_mask, pack)
        out = model(input_ids=shard.input_ids, use_cache=False,
                    **shard.model_kwargs()).logits                        # [B, T/sp, C]
        local = out.reshape(-1, out.shape[-1])[shard.rows]
        return sum_rows(local, shard, int(response_mask.bool().sum()), mesh)
    if pack:
        input_ids, positions, predicting = _packed_inputs(prompt_ids, prompt_mask, responses,
                                                          response_mask, attention_mask)
        out = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        return out[0, predicting]
    input_ids, attention, prompt_len, last = _trimmed_inputs(prompt_ids, prompt_mask, responses,
                                                             attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention,
                position_ids=position_ids_from_mask(attention), use_cache=False).logits
    # Position i predicts token i+1: response token j is predicted at column P'-1+j.
    start = prompt_len - 1
    return out[:, start:start + last][response_mask[:, :last].bool()]


def _vocab_parallel_stats(hidden: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None, targets: torch.Tensor, temperature: float,
                          with_entropy: bool, with_sum_pi_squared: bool = False,
                          removed: Sequence[int] = ()) -> torch.Tensor:
    """One chunk of a head sharded over the vocabulary (tensor parallelism): hidden [n, H],
    targets [n] -> [n, 3] as `head_token_stats`, with [n, V / tp] logits alive
    (vocab_parallel.py)."""
    if removed:
        raise ValueError("tokens removed from the policy (an image-text model's image pad) "
                         "with the LM head sharded over the vocabulary: not supported")
    return vocab_parallel_token_stats(hidden, weight, bias, targets, temperature,
                                      with_entropy, with_sum_pi_squared)


def _chunked_head(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                  temperature: float, with_entropy: bool, chunk_tokens: int,
                  with_sum_pi_squared: bool = False, removed: Sequence[int] = ()) -> torch.Tensor:
    """(log p_y, entropy, Σp²) of [N, H] hidden states in chunks of `chunk_tokens` rows ->
    [N, 3]. Neither the [N, V] logits nor their gradient is ever whole: each chunk's logits
    are recomputed in backward, one extra head matmul per chunk for a [N, V] -> [chunk, V]
    peak. A whole head runs head_stats.py's hand-written backward; a head sharded over the
    vocabulary (tensor parallelism) checkpoints each chunk of `_vocab_parallel_stats`."""
    if not is_vocab_sharded(head.weight):
        return head_token_stats(hidden, head.weight, head.bias, targets, temperature,
                                with_entropy, with_sum_pi_squared, removed, chunk_tokens)
    n = hidden.shape[0]
    step = chunk_tokens if chunk_tokens > 0 else max(n, 1)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    parts = []
    for i in range(0, max(n, 1), step):   # an empty batch still yields a (0-row) graph node
        args = (hidden[i:i + step], head.weight, head.bias, targets[i:i + step], temperature,
                with_entropy, with_sum_pi_squared, removed)
        parts.append(checkpoint(_vocab_parallel_stats, *args, use_reentrant=False) if grad
                     and n > step else _vocab_parallel_stats(*args))
    return torch.cat(parts)


@contextmanager
def _head_forward(head: torch.nn.Module, forward):
    """Run `forward` in place of the LM head's own for one pass. The module and its parameter
    names stay (FSDP2, weight sync and checkpoints see the same model); the head still runs
    inside the model's forward, where FSDP2 has gathered its weight."""
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


@dataclass
class LayoutInputs:
    """The model's inputs in one layout, and where its hidden states predict the targets."""
    input_ids: torch.Tensor
    kwargs: dict
    targets: torch.Tensor                    # [n] the response tokens scored here
    pick: Callable[[torch.Tensor], torch.Tensor]   # hidden states -> [n, H] that predict them
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None   # [n, 3] -> [N, 3]


def _layout_inputs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   responses: torch.Tensor, response_mask: torch.Tensor,
                   attention_mask: torch.Tensor, *, pack: bool, share_prompts: bool,
                   images: ImageInputs | None) -> LayoutInputs:
    """The inputs of `response_logprobs`'s layout: a sequence shard, shared prompts, one packed
    row, or padded rows (see there)."""
    used = response_mask.bool()                                               # [B, R]
    targets = responses[used]                                                 # [N]
    mesh = sequence_parallel_mesh(model)
    finish = None
    if mesh is not None:   # this rank's 1/sp of every sequence (ulysses.py)
        shard = _sequence_shard(model, mesh, prompt_ids, prompt_mask, responses, response_mask,
                                attention_mask, pack)
        input_ids = shard.input_ids
        kwargs = shard.model_kwargs()
        n_used = len(targets)
        targets = targets[shard.order]                                        # [n] here

        def pick(hidden: torch.Tensor) -> torch.Tensor:                      # [B, T/sp, H]
            return hidden.reshape(-1, hidden.shape[-1])[shard.rows]           # [n, H]

        def finish(rows: torch.Tensor) -> torch.Tensor:                      # [n, 3] -> [N, 3]
            return sum_rows(rows, shard, n_used, mesh)
    elif share_prompts:
        kwargs, predicting = _shared_prompt_kwargs(model, prompt_ids, prompt_mask, responses,
                                                   response_mask, attention_mask)
        input_ids = kwargs.pop("input_ids")

        def pick(hidden: torch.Tensor) -> torch.Tensor:                      # [G, T, H]
            return hidden.reshape(-1, hidden.shape[-1])[predicting]           # [N, H]
    elif pack:
        input_ids, positions, predicting = _packed_inputs(prompt_ids, prompt_mask, responses,
                                                          response_mask, attention_mask)
        kwargs = {"position_ids": positions}

        def pick(hidden: torch.Tensor) -> torch.Tensor:                      # [1, T, H]
            return hidden[0, predicting]                                      # [N, H]
    else:
        input_ids, attention, _, last = _trimmed_inputs(prompt_ids, prompt_mask, responses,
                                                        attention_mask)
        positions = (position_ids_from_mask(attention) if images is None
                     else rope_positions(model, input_ids, attention, images)[0])
        kwargs = {"attention_mask": attention, "position_ids": positions,
                  "logits_to_keep": last + 1, **image_kwargs(images)}

        def pick(hidden: torch.Tensor) -> torch.Tensor:                      # [B, K, H]
            # hidden ends with the last input position, which predicts nothing here; the R'
            # before it predict the response tokens.
            return hidden[:, hidden.shape[1] - last - 1:-1][used[:, :last]]  # [N, H]

    return LayoutInputs(input_ids, kwargs, targets, pick, finish)


def response_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      responses: torch.Tensor, response_mask: torch.Tensor, *,
                      attention_mask: torch.Tensor | None = None,
                      temperature: float = 1.0, with_entropy: bool = False,
                      chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      pack: bool = False,
                      with_sum_pi_squared: bool = False,
                      images: ImageInputs | None = None,
                      share_prompts: bool = False) -> ResponseLogprobs:
    """log softmax(z_t / T)[y_t] for every response token y_t: [B, R] (0 where masked).

    prompt_ids/prompt_mask: [B, P] left-padded; responses/response_mask: [B, R] right-padded.
    `attention_mask` [B, R]: the response tokens the model reads, a superset of `response_mask`
    (default: the same). They differ in multi-turn responses: the tool and environment tokens
    between the policy's turns are read (attended to) but get no log-prob (0 there).
    No [B, T, V] logits tensor is built: the head runs on the N used response tokens' hidden
    states alone, in chunks of `chunk_tokens` (0: all at once). `pack`: the rows go through
    the model as one packed row without padding (`_packed_inputs`); `share_prompts`: each
    distinct prompt once, its samples' responses after it (shared_prompts.py; it takes
    precedence over `pack`); otherwise padded, minus the columns that are padding in every
    row, keeping only the response positions' hidden states (`logits_to_keep`). A model set
    up for sequence parallelism (ulysses.py) runs 1/sp of the columns of either layout on
    each rank; the per-token results are summed over the sp group, so every rank returns the
    whole [B, R].
    `images`: the rows' images in row order, for an image-text model (data/vision.py);
    its tokens then get M-RoPE positions (padded layout only), and the policy scored is the
    model's distribution without its image pad (`unemittable_tokens`), as the rollouts sample.
    """
    if images is not None and (pack or sequence_parallel_mesh(model) is not None):
        raise ValueError("images go through the padded layout only: M-RoPE positions are not "
                         "computed for packed rows or sequence shards")
    _check_layout(model, share_prompts, images)
    batch, resp_len = responses.shape
    images = images.to(responses.device) if images is not None else None
    attention_mask = response_mask if attention_mask is None else attention_mask
    used = response_mask.bool()                                               # [B, R]
    head = model.get_output_embeddings()
    inputs = _layout_inputs(model, prompt_ids, prompt_mask, responses, response_mask,
                            attention_mask, pack=pack, share_prompts=share_prompts,
                            images=images)
    removed = unemittable_tokens(model)

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:
        return _chunked_head(inputs.pick(hidden), head, inputs.targets, temperature,
                             with_entropy, chunk_tokens, with_sum_pi_squared, removed)

    with _head_forward(head, head_forward):
        per_token = model(input_ids=inputs.input_ids, use_cache=False,
                          **inputs.kwargs).logits                             # [N, 3]
    if inputs.finish is not None:
        per_token = inputs.finish(per_token)
    out = per_token.new_zeros(batch, resp_len, 3)
    out[used] = per_token                                                     # [B, R, 3]
    return ResponseLogprobs(out[..., 0], out[..., 1] if with_entropy else None,
                            out[..., 2] if with_sum_pi_squared else None)


def response_values(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    responses: torch.Tensor, response_mask: torch.Tensor, *,
                    attention_mask: torch.Tensor | None = None,
                    pack: bool = False, share_prompts: bool = False) -> torch.Tensor:
    """V(s_t) for the state before each response token of `response_mask`, from a scalar-head
    model: [B, R] (0 elsewhere); `attention_mask`, `pack` and `share_prompts` as in
    `response_logprobs`."""
    used = response_mask.bool()
    attention_mask = response_mask if attention_mask is None else attention_mask
    out = _response_outputs(model, prompt_ids, prompt_mask, responses, response_mask,
                            attention_mask, pack, share_prompts)
    values = torch.zeros(responses.shape, device=responses.device)
    values[used] = out[..., 0].float()
    return values


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: Batch, *, micro_batch_size: int,
                   temperature: float, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                   max_tokens: int = 0, pack: bool = False,
                   share_prompts: bool = False) -> torch.Tensor:
    """Forward-only log-probs for a whole batch, in micro-batches (engines/micro_batches.py):
    -> [N, R] in batch order."""
    return batch_logprob_stats(model, batch, micro_batch_size=micro_batch_size,
                               temperature=temperature, chunk_tokens=chunk_tokens,
                               max_tokens=max_tokens, pack=pack, share_prompts=share_prompts)[0]


@torch.no_grad()
def batch_logprob_stats(model: torch.nn.Module, batch: Batch, *, micro_batch_size: int,
                        temperature: float, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                        max_tokens: int = 0, pack: bool = False,
                        with_sum_pi_squared: bool = False, share_prompts: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`batch_logprobs`, and with `with_sum_pi_squared` also Σ_v π(v | s_t)² per response token:
    -> ([N, R], [N, R] or None) in batch order."""
    out = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    sum_sq = torch.zeros_like(out) if with_sum_pi_squared else None
    for idx, mb in micro_batches(batch, micro_batch_size, max_tokens, share_prompts):
        if len(mb):
            res = response_logprobs(
                model, mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
                attention_mask=response_attention(mb), temperature=temperature,
                chunk_tokens=chunk_tokens, pack=pack, with_sum_pi_squared=with_sum_pi_squared,
                images=batch_images(mb), share_prompts=share_prompts)
            out[idx.to(out.device)] = res.logprobs
            if sum_sq is not None:
                sum_sq[idx.to(out.device)] = res.sum_pi_squared
    return out, sum_sq


@torch.no_grad()
def batch_values(model: torch.nn.Module, batch: Batch, *, micro_batch_size: int,
                 max_tokens: int = 0, pack: bool = False,
                 share_prompts: bool = False) -> torch.Tensor:
    """Forward-only values for a whole batch, in micro-batches: -> [N, R] in batch order."""
    out = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    for idx, mb in micro_batches(batch, micro_batch_size, max_tokens, share_prompts):
        if len(mb):
            out[idx.to(out.device)] = response_values(
                model, mb["prompt_ids"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
                attention_mask=response_attention(mb), pack=pack,
                share_prompts=share_prompts)
    return out
