"""Teacher-forced log-probs of responses under a model: shared by the actor, the reference and
the old-logprob pass, so all three compute exactly the same quantity as the rollout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dagrl.algorithms.utils import entropy_from_logits, logprobs_from_logits
from dagrl.data.batch import Batch
from dagrl.engines.generator import position_ids_from_mask


@dataclass
class ResponseLogprobs:
    logprobs: torch.Tensor                 # [B, R]
    entropy: torch.Tensor | None = None    # [B, R]


def response_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      responses: torch.Tensor, response_mask: torch.Tensor, *,
                      temperature: float = 1.0, with_entropy: bool = False) -> ResponseLogprobs:
    """log softmax(z_t / T)[y_t] for every response token y_t.

    prompt_ids/prompt_mask: [B, P] left-padded; responses/response_mask: [B, R] right-padded.
    Columns that are padding for every row are trimmed before the forward pass (the layout is
    fixed-width, so a batch of short prompts carries many), and the outputs are padded back to R.
    """
    batch, resp_len = responses.shape
    # Trim all-padding columns: leading prompt columns and trailing response columns.
    first = int(prompt_mask.any(0).float().argmax()) if prompt_mask.any() else prompt_mask.shape[1]
    last = int(response_mask.any(0).nonzero().max()) + 1 if response_mask.any() else 0
    p_ids, p_mask = prompt_ids[:, first:], prompt_mask[:, first:]
    r_ids, r_mask = responses[:, :last], response_mask[:, :last]

    input_ids = torch.cat([p_ids, r_ids], dim=1)
    attention = torch.cat([p_mask, r_mask], dim=1).long()
    positions = position_ids_from_mask(attention)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                   use_cache=False).logits
    # The logit at position i predicts token i+1: response token j is predicted from column
    # P'-1+j, where P' is the trimmed prompt width.
    start = p_ids.shape[1] - 1
    logits = logits[:, start:start + last, :].float() / temperature     # [B, R', V]

    logprobs = torch.zeros(batch, resp_len, device=responses.device)
    logprobs[:, :last] = logprobs_from_logits(logits, r_ids)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(batch, resp_len, device=responses.device)
        entropy[:, :last] = entropy_from_logits(logits)
    mask = response_mask.to(logprobs.dtype)
    return ResponseLogprobs(logprobs * mask, entropy * mask if entropy is not None else None)


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: Batch, *, micro_batch_size: int,
                   temperature: float) -> torch.Tensor:
    """Forward-only log-probs for a whole batch, in micro-batches: -> [N, R]."""
    parts = []
    for mb in batch.split(micro_batch_size):
        parts.append(response_logprobs(model, mb["prompt_ids"], mb["prompt_mask"],
                                       mb["responses"], mb["response_mask"],
                                       temperature=temperature).logprobs)
    if not parts:
        return torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    return torch.cat(parts)
