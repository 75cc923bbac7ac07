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

    def attention_mask(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """The [G, 1, T, T] mask transformers passes through unchanged to the attention: bool
        for SDPA (its own masks are bool), additive (0 or the dtype's minimum) for the eager
        and dagrl_grouped kernels, which add it to the scores."""
        mask = self.allowed[:, None]
        if attn_implementation == "sdpa":
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min)


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
    predicting = []
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
                              torch.cat(predicting) if predicting else empty)
