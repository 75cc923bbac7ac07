"""The built-in rollout generator: batched KV-cache decoding of a HF causal LM.

Llama / Qwen2-layout models decode on the fast path (`dagrl.engines.fast_generator`: own
forward pass over the model's weights, preallocated KV cache, finished rows compacted out);
every other architecture uses the HF-forward loop below. Both produce the same outputs.

Input prompts are left-padded to a fixed width P, so every sequence's last prompt token sits in
column P-1 and one batched prefill serves all of them. Decoding appends one token per step for
the whole batch; in the HF loop a sequence that has emitted EOS keeps decoding pad tokens
(masked out) until every sequence is done or max_new_tokens is reached. Responses are
right-padded to exactly max_new_tokens columns, so batches from different steps or workers
concatenate without re-padding.

The returned log-probs are log softmax(z / T) at the sampled token (T = 1 for greedy), the same
quantity the actor recomputes in training, before any top-k/top-p truncation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from dagrl.algorithms.utils import logprobs_from_logits
from dagrl.engines.fast_generator import FastDecoder, fast_path_unsupported
from dagrl.engines.sampling import SamplingParams, sample_next_token


@dataclass
class GenerationOutput:
    responses: torch.Tensor       # [B, R] int64, pad after EOS
    response_mask: torch.Tensor   # [B, R] float32, 1 up to and including EOS
    logprobs: torch.Tensor        # [B, R] float32, 0 where masked


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: [B, L] mask -> [B, L] ids (0 at the first real token)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class Generator:
    """Holds an inference copy of the policy and samples responses from it.

    The copy is separate from the trained actor (which later issues shard with FSDP2); after
    each update the actor's full weights are copied in with `load_weights`.
    """

    def __init__(self, model: PreTrainedModel, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), fast: bool = True) -> None:
        self.model = model.eval().requires_grad_(False)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # A response ends at EOS or at any of these (rollout.stop_token_ids); the stop token is
        # part of the response, as EOS is.
        self.stop_token_ids = list(dict.fromkeys([eos_token_id, *stop_token_ids]))
        self.weights_version = 0
        # The fast decoder reads the model's own weight tensors on every call, so in-place
        # `load_weights` updates reach it with nothing to resynchronise.
        self.fast = FastDecoder(model) if fast and fast_path_unsupported(model) is None else None

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy parameters in place by name; every parameter of the generator must be given."""
        params = dict(self.model.named_parameters())
        seen = set()
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight sync: the generator has no parameter {name!r}")
            params[name].copy_(tensor)
            seen.add(name)
        missing = set(params) - seen
        if missing:
            raise KeyError(f"weight sync: no value given for {sorted(missing)[:5]}")
        self.weights_version = version

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0) -> GenerationOutput:
        """Sample one response per row. prompt_ids/prompt_mask: [B, P] left-padded; sample_seed: [B]."""
        if self.fast is not None:
            responses, mask, logprobs = self.fast.generate(
                prompt_ids, prompt_mask, sample_seed, params, max_new_tokens=max_new_tokens,
                min_new_tokens=min_new_tokens, stop_token_ids=self.stop_token_ids,
                pad_token_id=self.pad_token_id)
            return GenerationOutput(responses=responses, response_mask=mask, logprobs=logprobs)
        device = prompt_ids.device
        batch, _ = prompt_ids.shape
        attention = prompt_mask.long()
        positions = position_ids_from_mask(attention)
        cache = DynamicCache()
        out = self.model(input_ids=prompt_ids, attention_mask=attention, position_ids=positions,
                         past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :].float()            # [B, V]
        next_pos = positions[:, -1:] + 1                  # [B, 1]

        responses = torch.full((batch, max_new_tokens), self.pad_token_id, dtype=torch.long,
                               device=device)
        logprobs = torch.zeros(batch, max_new_tokens, device=device)
        mask = torch.zeros(batch, max_new_tokens, device=device)
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        stop = torch.tensor(self.stop_token_ids, dtype=torch.long, device=device)
        temperature = params.temperature if params.temperature > 0 else 1.0

        for t in range(max_new_tokens):
            allowed = logits
            if t < min_new_tokens:
                allowed = logits.clone()
                allowed[:, stop] = float("-inf")
            token = sample_next_token(allowed, params, sample_seed, t)
            # The log-prob of the model's own distribution (not the EOS-masked one): it is the
            # quantity the actor recomputes, so the two agree.
            logp = logprobs_from_logits(logits / temperature, token)
            token = torch.where(alive, token, torch.full_like(token, self.pad_token_id))
            responses[:, t] = token
            logprobs[:, t] = torch.where(alive, logp, torch.zeros_like(logp))
            mask[:, t] = alive.float()
            alive = alive & ~torch.isin(token, stop)
            if not alive.any() or t == max_new_tokens - 1:
                break
            attention = torch.cat([attention, torch.ones(batch, 1, dtype=attention.dtype,
                                                         device=device)], dim=1)
            out = self.model(input_ids=token[:, None], attention_mask=attention,
                             position_ids=next_pos, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        return GenerationOutput(responses=responses, response_mask=mask, logprobs=logprobs)
