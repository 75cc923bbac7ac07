"""Teacher-forced passes over (prompt, response): log-probs for the actor, the reference and the
old-logprob pass (so all compute exactly the quantity the rollout sampled with), and values for
the critic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dagrl.algorithms.utils import entropy_from_logits, logprobs_from_logits
from dagrl.data.batch import Batch
from dagrl.rollout.hf import position_ids_from_mask


@dataclass
class ResponseLogprobs:
    logprobs: torch.Tensor                 # [B, R]
    entropy: torch.Tensor | None = None    # [B, R]


def _response_outputs(model: torch.nn.Module, prompt_ids, prompt_mask, responses,
                      response_mask) -> tuple[torch.Tensor, int]:
    """Run the model on [prompt | response] and return its outputs at the positions that
    *predict* each response token: [B, R', ...] with R' = the last used response column + 1.

    Columns that are padding for every row are trimmed before the pass (the layout is
    fixed-width, so a batch of short prompts carries many).
    """
    first = int(prompt_mask.any(0).float().argmax()) if prompt_mask.any() else prompt_mask.shape[1]
    last = int(response_mask.any(0).nonzero().max()) + 1 if response_mask.any() else 0
    p_ids, p_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    input_ids = torch.cat([p_ids, responses[:, :last]], dim=1)
    attention = torch.cat([p_mask, response_mask[:, :last]], dim=1).long()
    out = model(input_ids=input_ids, attention_mask=attention,
                position_ids=position_ids_from_mask(attention), use_cache=False).logits
    # Position i predicts token i+1: response token j is predicted at column P'-1+j.
    start = p_ids.shape[1] - 1
    return out[:, start:start + last], last


def response_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      responses: torch.Tensor, response_mask: torch.Tensor, *,
                      temperature: float = 1.0, with_entropy: bool = False) -> ResponseLogprobs:
    """log softmax(z_t / T)[y_t] for every response token y_t: [B, R] (0 where masked).

    prompt_ids/prompt_mask: [B, P] left-padded; responses/response_mask: [B, R] right-padded.
    """
    batch, resp_len = responses.shape
    logits, last = _response_outputs(model, prompt_ids, prompt_mask, responses, response_mask)
    logits = logits.float() / temperature                               # [B, R', V]
    mask = response_mask.float()
    logprobs = torch.zeros(batch, resp_len, device=responses.device)
    logprobs[:, :last] = logprobs_from_logits(logits, responses[:, :last])
    entropy = None
    if with_entropy:
        entropy = torch.zeros(batch, resp_len, device=responses.device)
        entropy[:, :last] = entropy_from_logits(logits)
        entropy = entropy * mask
    return ResponseLogprobs(logprobs * mask, entropy)


def response_values(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    responses: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """V(s_t) for the state before each response token, from a scalar-head model: [B, R]."""
    batch, resp_len = responses.shape
    out, last = _response_outputs(model, prompt_ids, prompt_mask, responses, response_mask)
    values = torch.zeros(batch, resp_len, device=responses.device)
    values[:, :last] = out[..., 0].float()
    return values * response_mask.float()


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: Batch, *, micro_batch_size: int,
                   temperature: float) -> torch.Tensor:
    """Forward-only log-probs for a whole batch, in micro-batches: -> [N, R]."""
    parts = [response_logprobs(model, mb["prompt_ids"], mb["prompt_mask"], mb["responses"],
                               mb["response_mask"], temperature=temperature).logprobs
             for mb in batch.split(micro_batch_size) if len(mb)]
    if not parts:
        return torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    return torch.cat(parts)


@torch.no_grad()
def batch_values(model: torch.nn.Module, batch: Batch, *, micro_batch_size: int) -> torch.Tensor:
    """Forward-only values for a whole batch, in micro-batches: -> [N, R]."""
    parts = [response_values(model, mb["prompt_ids"], mb["prompt_mask"], mb["responses"],
                             mb["response_mask"])
             for mb in batch.split(micro_batch_size) if len(mb)]
    if not parts:
        return torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    return torch.cat(parts)
