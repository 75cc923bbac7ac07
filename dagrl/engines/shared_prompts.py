"""The shared-prompt layout of a teacher-forced pass (`model.share_prompts`): each distinct
prompt of a micro-batch is computed once, and the responses of every sample that has it follow
it in the same row.

    row g:   [ prompt_g | response_a | response_b | ... | padding ]
    token i may attend to token j  <=>  j <= i  and  (j is in prompt_g  or  i, j in one response)

A GRPO group's n samples share their prompt, so with prompts of P tokens and responses of R the
decoder layers run P + nR tokens per group instead of n(P + R): for SmolLM2 on gsm8k-synth
(P ~ 96, R ~ 48, n = 4) half the tokens, and the update's and the reference pass's time with
them. The numbers are those of the padded layout: a prompt's activations do not depend on the
response after it (causal attention), so every sample would compute the same ones; the
responses read them through the tree mask above, and in backward the gradients the samples
send into the shared prompt sum, as the n copies' gradients would. (The rollout's prefill does
the same per distinct prompt: rollout/native_decoder.py.) The idea is the "shared-prefix
forward" of Prefix Grouper (Liu et al., 2025).

Rows are told apart by their prompt tokens, not by a group id, so any batch is valid: samples
with a prompt of their own get a row of their own (the packed layout without the saving).

The tree mask leaves most of a row's [T, T] attention scores masked: every response against the
row's other responses. `AttentionBlocks` cuts the attention into dense blocks that hold the
allowed scores (cascade attention), which `dagrl_grouped` computes instead of the rows:

    prompts      [G, Pm] queries x [Pm] keys, causal
    responses    per block of Rb responses of similar length, [Rb, Lb] queries x [Pm + Lb]
                 keys: its prompt's, then its own (causal)

With n responses of L tokens after a P-token prompt a row holds (P + nL)^2 scores, the blocks
P^2 + nL(P + L): 3.2x fewer for P = 60, n = 4, L = 128. Responses of different lengths go to
different blocks, so a short one is not padded to the longest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_PROMPT, _PADDING = -1, -2           # segment ids; a response's segment is its sample's index


@dataclass
class SharedPromptInputs:
    input_ids: torch.Tensor       # [G, T]: G distinct prompts, each followed by its responses
    position_ids: torch.Tensor    # [G, T]: a response continues its prompt's positions
    allowed: torch.Tensor         # [G, T, T] bool: which tokens each token attends to
    predicting: torch.Tensor      # [N]: flat index into [G * T] of the position predicting
    #                               each used response token (row-major over response_mask)
    prompt_lengths: list[int]     # [G]: each row's prompt tokens
    spans: list[tuple[int, int, int]]   # (row, first column, tokens) of each nonempty response

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """The [G, 1, T, T] mask transformers passes through unchanged to the attention: bool
        for SDPA (its own masks are bool), additive (0 or the dtype's minimum) for the eager
        and dagrl_grouped kernels, which add it to the scores."""
        mask = self.allowed[:, None]
        if attn_implementation == "sdpa":
            return mask
        return _additive(mask, dtype)

    def attention_blocks(self, dtype: torch.dtype) -> AttentionBlocks | None:
        """The attention cut into its prompt block and response blocks, masks additive in
        `dtype`; None when the blocks would hold as many scores as the rows."""
        rows, width = self.input_ids.shape
        prompt_width = max(self.prompt_lengths)
        buckets = _length_buckets([n for _, _, n in self.spans], prompt_width)
        sizes = [(len(b), self.spans[b[0]][2]) for b in buckets]        # (Rb, Lb) per block
        block_scores = rows * prompt_width ** 2 + sum(
            n * length * (prompt_width + length) for n, length in sizes)
        if block_scores >= rows * width ** 2:
            return None
        device = self.input_ids.device
        causal = torch.ones(prompt_width, prompt_width, dtype=torch.bool, device=device).tril()
        # Output of column c of row g: the prompt block's while c is in the prompt, a response
        # block's at the span's position, else (padding) the zero row after every block.
        zero_row = rows * prompt_width + sum(n * length for n, length in sizes)
        index = torch.full((rows * width,), zero_row, dtype=torch.long, device=device)
        for g, length in enumerate(self.prompt_lengths):
            index[g * width:g * width + length] = torch.arange(
                g * prompt_width, g * prompt_width + length, device=device)
        blocks, offset = [], rows * prompt_width
        for bucket in buckets:
            block, columns, positions = _response_block([self.spans[i] for i in bucket],
                                                        self.prompt_lengths, width,
                                                        prompt_width, dtype, device)
            index[columns] = offset + positions
            blocks.append(block)
            offset += block.columns.numel()
        return AttentionBlocks(_additive(causal[None, None], dtype), blocks, index)


@dataclass
class ResponseBlock:
    """Rb responses of up to Lb tokens, each against its prompt's keys and its own."""
    rows: torch.Tensor       # [Rb]: the row, and so the prompt, of each response
    columns: torch.Tensor    # [Rb * Lb]: flat [G * T] index of each block position
    mask: torch.Tensor       # [Rb, 1, Lb, Pm + Lb] additive: its prompt, then itself causally


@dataclass
class AttentionBlocks:
    """Cascade attention of a shared-prompt micro-batch (G rows of T columns): the prompts'
    block, the responses' blocks (responses of similar length together, so that few scores
    are padding), and where each column's output is. See the module docstring."""
    prompt_mask: torch.Tensor        # [1, 1, Pm, Pm]: causal, the same for every row (the
    #                                  outputs of columns past a row's prompt are not read)
    responses: list[ResponseBlock]
    output_index: torch.Tensor       # [G * T] into [prompt block (G * Pm) | each response
    #                                  block (Rb * Lb) | a zero row (padding columns)]


# A block costs a few dozen small ops per layer beyond its scores, about what this many more
# scores cost on CPU: a response joins a block of longer ones while its padding costs less.
BLOCK_OVERHEAD_SCORES = 4096


def _length_buckets(lengths: list[int], prompt_width: int) -> list[list[int]]:
    """Indices of `lengths` in blocks, longest first: a response joins the current block
    (padded to the block's first, longest response) while the scores its padding adds,
    Lb (Pm + Lb) - L (Pm + L), stay under BLOCK_OVERHEAD_SCORES."""
    buckets: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if buckets:
            top, n = lengths[buckets[-1][0]], lengths[i]
            if top * (prompt_width + top) - n * (prompt_width + n) <= BLOCK_OVERHEAD_SCORES:
                buckets[-1].append(i)
                continue
        buckets.append([i])
    return buckets


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def _response_block(spans: list[tuple[int, int, int]], prompt_lengths: list[int], width: int,
                    prompt_width: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[ResponseBlock, torch.Tensor, torch.Tensor]:
    """The block of `spans` (longest first), the [G * T] columns of its response tokens and
    their positions in the flat [Rb * Lb] block."""
    rows, starts, lengths = (torch.tensor(x, dtype=torch.long, device=device)
                             for x in zip(*spans, strict=True))
    steps = torch.arange(int(lengths[0]), device=device)
    real = steps[None] < lengths[:, None]                                      # [Rb, Lb]
    # A block position past its response reads its response's first column (masked out).
    columns = rows[:, None] * width + starts[:, None] + torch.where(real, steps, 0)
    sees_prompt = (torch.arange(prompt_width, device=device)[None]
                   < torch.tensor(prompt_lengths, device=device)[rows][:, None])  # [Rb, Pm]
    sees_self = (steps[None, None] <= steps[None, :, None]) & real[:, None]     # [Rb, Lb, Lb]
    allowed = torch.cat([sees_prompt[:, None].expand(-1, len(steps), -1), sees_self], -1)
    positions = torch.arange(real.numel(), device=device).view(real.shape)
    block = ResponseBlock(rows, columns.reshape(-1), _additive(allowed[:, None], dtype))
    return block, columns[real], positions[real]


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
                     ) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct prompts of [B, P] left-padded rows (their real tokens) and each row's
    index into them."""
    prompts: list[torch.Tensor] = []
    index: dict[tuple[int, ...], int] = {}
    row_prompt = []
    for ids, keep in zip(prompt_ids, prompt_mask.bool(), strict=True):
        tokens = ids[keep]
        key = tuple(tokens.tolist())
        if key not in index:
            index[key] = len(prompts)
            prompts.append(tokens)
        row_prompt.append(index[key])
    return prompts, row_prompt


def shared_prompt_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                         responses: torch.Tensor, response_mask: torch.Tensor,
                         attention_mask: torch.Tensor) -> SharedPromptInputs:
    """The shared-prompt layout of a micro-batch. prompt_ids/prompt_mask [B, P] left-padded;
    responses [B, R] right-padded; `attention_mask` [B, R]: the response tokens the model reads
    (a multi-turn response's tool tokens too), `response_mask` [B, R]: those predicted."""
    prompts, row_prompt = distinct_prompts(prompt_ids, prompt_mask)
    read = attention_mask.bool()
    lengths = [len(p) for p in prompts]            # each row's used width so far
    starts = []                                    # (row, first column) of each response
    for b, g in enumerate(row_prompt):
        starts.append((g, lengths[g]))
        lengths[g] += int(read[b].sum())
    rows, width, device = len(prompts), max(lengths), responses.device
    input_ids = torch.zeros(rows, width, dtype=prompt_ids.dtype, device=device)
    positions = torch.zeros(rows, width, dtype=torch.long, device=device)
    segment = torch.full((rows, width), _PADDING, dtype=torch.long, device=device)
    predicting, spans = [], []
    for g, tokens in enumerate(prompts):
        input_ids[g, :len(tokens)] = tokens
        positions[g, :len(tokens)] = torch.arange(len(tokens), device=device)
        segment[g, :len(tokens)] = _PROMPT
    for b, (g, start) in enumerate(starts):
        tokens = responses[b][read[b]]
        n = len(tokens)
        if n == 0:
            continue
        prompt_len = len(prompts[g])
        input_ids[g, start:start + n] = tokens
        positions[g, start:start + n] = torch.arange(prompt_len, prompt_len + n, device=device)
        segment[g, start:start + n] = b
        spans.append((g, start, n))
        # Token k of the response is predicted at the column before it; token 0 by the
        # prompt's last token, which every response of the row shares.
        columns = torch.arange(start - 1, start + n - 1, device=device)
        columns[0] = prompt_len - 1
        used = response_mask[b].bool()[read[b]]       # the read tokens that get a log-prob
        predicting.append(g * width + columns[used])
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    same = (segment[:, None, :] == segment[:, :, None]) | (segment[:, None, :] == _PROMPT)
    allowed = causal & same
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return SharedPromptInputs(input_ids, positions, allowed,
                              torch.cat(predicting) if predicting else empty,
                              [len(p) for p in prompts], spans)
