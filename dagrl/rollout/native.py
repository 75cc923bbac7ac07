"""`rollout.backend=native`: dagrl's own decoder for Llama / Qwen2-layout models
(native_decoder.py: a forward pass over the model's weight tensors, fused projections, one
prefill per distinct prompt, a preallocated KV cache, finished rows dropped). It runs
anywhere torch runs and needs nothing beyond the model; on CPU it is several times faster than
the HF loop (docs/performance.md). Models it cannot reproduce exactly are refused with the
reason (`unsupported_reason`); `rollout.backend=auto` then picks `hf`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dagrl.config.schema import Config
from dagrl.rollout.base import GenerationOutput, ModelCopy, RolloutBuild, RolloutEngine
from dagrl.rollout.native_decoder import FastDecoder, fast_path_unsupported
from dagrl.rollout.registry import ROLLOUT_BACKENDS
from dagrl.rollout.sampling import SamplingParams

unsupported_reason = fast_path_unsupported


@ROLLOUT_BACKENDS.register("native")
class NativeRollout(ModelCopy):
    # The decoder reads the model's weight tensors directly (no module forward, so neither
    # train mode nor the actor's hooks reach it): with one worker it can read the actor's own.
    shares_actor_weights = True

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), shared: bool = False) -> None:
        reason = fast_path_unsupported(model)
        if reason is not None:
            raise ValueError(f"rollout.backend=native cannot run this model: {reason}; use "
                             "rollout.backend=hf (or auto)")
        super().__init__(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         stop_token_ids=stop_token_ids, shared=shared)
        # The decoder reads the model's own weight tensors on every call, so in-place
        # `update_weights` copies (or, shared with the actor, its optimizer's in-place steps)
        # reach it with nothing to resynchronise.
        self.decoder = FastDecoder(self.model)

    @classmethod
    def from_config(cls, cfg: Config, build: RolloutBuild) -> RolloutEngine:
        """Over the actor itself when it is handed over and is a plain supported model (not
        LoRA-wrapped, which needs merged weights); else over a fresh copy."""
        actor = build.actor_model
        if actor is not None and unsupported_reason(actor) is None:
            return cls(actor, eos_token_id=build.eos_token_id, pad_token_id=build.pad_token_id,
                       stop_token_ids=build.stop_token_ids, shared=True)
        return super().from_config(cfg, build)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0) -> GenerationOutput:
        responses, mask, logprobs = self.decoder.generate(
            prompt_ids, prompt_mask, sample_seed, params, max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens, stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id)
        return GenerationOutput(responses=responses, response_mask=mask, logprobs=logprobs)
