"""The rollout seam: what every generation backend provides, and what they share.

A backend holds an inference copy of the policy, samples responses for left-padded prompts,
and takes new weights after each update. The rollout node, validation and ReMax's greedy
baseline only ever talk to this interface, so a backend (native, hf; vLLM and server mode in
their own modules) can be swapped with `rollout.backend` and nothing else changes.

Conventions every backend keeps (tests check them on each):
- prompts [B, P] are left-padded, so each row's last prompt token sits in column P-1;
- responses are right-padded to exactly `max_new_tokens` columns (batches from different steps
  or workers concatenate without re-padding), pad after the stop token;
- a response ends at the first of `stop_token_ids` (EOS included), which is part of it;
- token t of sample b is drawn with the uniform number `uniform_draws(sample_seed[b], t)`
  (sampling.py), so a sample's tokens do not depend on its batch or worker;
- `logprobs` are log softmax(z / T) at the sampled token (T = 1 for greedy), before top-k /
  top-p truncation: the quantity the actor recomputes in training.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dagrl.rollout.sampling import SamplingParams


@dataclass
class GenerationOutput:
    responses: torch.Tensor       # [B, R] int64, pad after the stop token
    response_mask: torch.Tensor   # [B, R] float32, 1 up to and including the stop token
    logprobs: torch.Tensor        # [B, R] float32, 0 where masked


class RolloutEngine(Protocol):
    """A generation backend (see the module docstring for the conventions)."""

    stop_token_ids: list[int]     # EOS first, then rollout.stop_token_ids
    weights_version: int          # the actor version whose weights it holds

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0) -> GenerationOutput:
        """One response per row. prompt_ids/prompt_mask: [B, P]; sample_seed: [B]."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Take every parameter of the policy, by name (streamed: each tensor is only
        valid until the next is drawn)."""


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: [B, L] mask -> [B, L] ids (0 at the first real token)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def stop_tokens(eos_token_id: int, extra: Sequence[int]) -> list[int]:
    """EOS and `rollout.stop_token_ids`, without repeats, EOS first."""
    return list(dict.fromkeys([eos_token_id, *extra]))


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real prompt tokens, for engines that take token-id lists: [B, P] -> B lists."""
    return [row[mask.bool()].tolist()
            for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]


def padded_output(tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                  max_new_tokens: int, pad_token_id: int,
                  device: torch.device) -> GenerationOutput:
    """Per-sample token and log-prob lists -> the fixed-width, right-padded GenerationOutput."""
    batch = len(tokens)
    responses = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch, max_new_tokens)
    out_logprobs = torch.zeros(batch, max_new_tokens)
    for i, (ids, lps) in enumerate(zip(tokens, logprobs, strict=True)):
        n = min(len(ids), max_new_tokens)
        responses[i, :n] = torch.tensor(list(ids[:n]), dtype=torch.long)
        mask[i, :n] = 1.0
        out_logprobs[i, :n] = torch.tensor(list(lps[:n]), dtype=torch.float32)
    return GenerationOutput(responses.to(device), mask.to(device), out_logprobs.to(device))


class ModelCopy:
    """A backend that generates with an in-process HF model (native and hf): holds the model
    and copies new weights into its parameters in place, so no second copy is ever made."""

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), shared: bool = False) -> None:
        """`shared`: `model` is the trained actor itself (one worker, native decoder), not a
        copy: it is left trainable, and there is never anything to sync."""
        self.model = model if shared else model.eval().requires_grad_(False)
        self.shared = shared
        self.pad_token_id = pad_token_id
        self.stop_token_ids = stop_tokens(eos_token_id, stop_token_ids)
        self.weights_version = 0

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Copy parameters in place by name; every parameter of the model must be given."""
        params = dict(self.model.named_parameters())
        seen = set()
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight sync: the rollout model has no parameter {name!r}")
            if params[name].data_ptr() != tensor.data_ptr():   # not a tensor shared with the actor
                params[name].copy_(tensor)
            seen.add(name)
        missing = set(params) - seen
        if missing:
            raise KeyError(f"weight sync: no value given for {sorted(missing)[:5]}")
        self.weights_version = version
