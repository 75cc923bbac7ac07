"""Rollout: generation behind one interface (`RolloutEngine`, base.py), chosen by
`rollout.backend`:

    native   dagrl's decoder for Llama / Qwen2 models (native.py), runs anywhere
    hf       the Hugging Face model's own forward (hf.py): any causal LM, the reference
    auto     native when it supports the model, else hf (the default)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from dagrl.rollout.base import GenerationOutput, RolloutEngine
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout, unsupported_reason
from dagrl.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)

BACKENDS = {"native": NativeRollout, "hf": HFRollout}


def build_rollout(backend: str, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                  stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
    """The rollout engine `backend` over `model` (an inference copy it then owns)."""
    if backend == "auto":
        reason = unsupported_reason(model)
        backend = "native" if reason is None else "hf"
        if reason is not None:
            logger.info("rollout.backend=auto: hf (the native decoder cannot run this model: %s)",
                        reason)
    if backend not in BACKENDS:
        raise ValueError(f"rollout.backend: unknown backend {backend!r}; choose auto, "
                         f"{', '.join(BACKENDS)}")
    return BACKENDS[backend](model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                             stop_token_ids=stop_token_ids)


__all__ = ["BACKENDS", "GenerationOutput", "RolloutEngine", "SamplingParams", "build_rollout"]
