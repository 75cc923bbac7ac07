"""`rollout.backend=hf`: batched KV-cache decoding with the Hugging Face model's own forward.

Runs any HF causal LM, and is the reference the other backends are checked against (the same
sampler, the same per-sample draws: greedy outputs are identical, sampled ones equal up to
float rounding of the logits). One batched prefill serves every row (prompts are left-padded),
then one token per step for the whole batch; a row that has stopped keeps decoding pad tokens
(masked out) until every row is done or `max_new_tokens` is reached.
"""

from __future__ import annotations

import inspect

import torch

from dagrl.algorithms.utils import logprobs_from_logits
from dagrl.data.positions import position_ids_from_mask
from dagrl.data.vision import (
    ImageInputs,
    image_kwargs,
    reads_images,
    remove_tokens,
    rope_positions,
    unemittable_tokens,
)
from dagrl.rollout.base import GenerationOutput, ModelCopy
from dagrl.rollout.registry import ROLLOUT_BACKENDS
from dagrl.rollout.sampling import SamplingParams, logprob_temperature, sample_next_token


def cache_argument(model: torch.nn.Module) -> str:
    """The name a model's forward takes its KV cache by: `cache` from transformers 5.2x on
    (`past_key_values` still works there, with a FutureWarning on every call), else
    `past_key_values` (vLLM's venv pins an older transformers)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


@ROLLOUT_BACKENDS.register("hf")
class HFRollout(ModelCopy):
    """Generation through `model(...)` with a `DynamicCache` (see the module docstring)."""

    # It calls the module's own forward, which on the trained actor would run in the actor's
    # train mode (dropout, activation checkpointing): it generates with an eval-mode copy.
    shares_actor_weights = False

    # An image-text model's images go into its prefill (data/vision.py).
    generates_from_images = True

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0, images: ImageInputs | None = None
                 ) -> GenerationOutput:
        """Sample one response per row. prompt_ids/prompt_mask: [B, P] left-padded;
        sample_seed: [B]; `images`: the rows' images in row order (an image-text model)."""
        device = prompt_ids.device
        batch, _ = prompt_ids.shape
        attention = prompt_mask.long()
        from transformers import DynamicCache  # lazily: config checks import this module

        cache = {cache_argument(self.model): DynamicCache()}
        # Tokens a response may not hold (an image-text model's image pad): the policy is the
        # distribution without them, sampled and scored alike (data/vision.py).
        never = unemittable_tokens(self.model)
        if reads_images(self.model.config):
            images = images.to(device) if images is not None else None
            # M-RoPE: the prompt's positions from its image grids; each new token's position
            # is one past the prompt's largest, on all three rows.
            positions, offset = rope_positions(self.model, prompt_ids, attention, images)
            kwargs = {"attention_mask": attention, "position_ids": positions,
                      **image_kwargs(images)}
            next_pos = attention.sum(-1, keepdim=True) + offset                 # [B, 1]
        else:
            kwargs = {"attention_mask": attention,
                      "position_ids": position_ids_from_mask(attention)}
            next_pos = kwargs["position_ids"][:, -1:] + 1                    # [B, 1]
        out = self.model(input_ids=prompt_ids, use_cache=True, **kwargs, **cache)
        logits = out.logits[:, -1, :].float()            # [B, V]

        responses = torch.full((batch, max_new_tokens), self.pad_token_id, dtype=torch.long,
                               device=device)
        logprobs = torch.zeros(batch, max_new_tokens, device=device)
        mask = torch.zeros(batch, max_new_tokens, device=device)
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        stop = torch.tensor(self.stop_token_ids, dtype=torch.long, device=device)
        temperature = logprob_temperature(params.temperature)

        for t in range(max_new_tokens):
            logits = remove_tokens(logits, never)
            allowed = logits
            if t < min_new_tokens:
                allowed = logits.clone()
                allowed[:, stop] = float("-inf")
            token = sample_next_token(allowed, params, sample_seed, t)
            # The log-prob of the policy's distribution (not the one with stop tokens held back
            # for min_new_tokens): the quantity the actor recomputes, so the two agree.
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
                             position_ids=next_pos, use_cache=True, **cache)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        return GenerationOutput(responses=responses, response_mask=mask, logprobs=logprobs)
