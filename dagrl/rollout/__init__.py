"""Rollout: generation behind one interface (`RolloutEngine`, base.py), chosen by
`rollout.backend`:

    native   dagrl's decoder for Llama / Qwen2 models (native.py), runs anywhere
    hf       the Hugging Face model's own forward (hf.py): any causal LM, the reference
    auto     native when it supports the model, else hf (the default)
    vllm     vLLM's engine in the worker process (vllm.py; the vllm extra)
    server   OpenAI-compatible servers you run (server.py): vLLM or SGLang, frozen weights

Multi-turn rollouts (agents: tools, environments) run on top of any of them: multi_turn.py,
with the chat formats and token bookkeeping of chat.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from dagrl.config.schema import Config
from dagrl.rollout.base import GenerationOutput, RolloutEngine
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout, unsupported_reason
from dagrl.rollout.sampling import SamplingParams
from dagrl.rollout.server import ServerRollout, ServerSettings
from dagrl.rollout.vllm import VLLMRollout, VLLMSettings  # imports vLLM only when built

logger = logging.getLogger(__name__)

# Backends that generate with an in-process copy of the HF model.
MODEL_BACKENDS = {"native": NativeRollout, "hf": HFRollout}


def model_rollout(backend: str, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                  stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
    """The `native`, `hf` or `auto` engine over `model` (an inference copy it then owns)."""
    if backend == "auto":
        reason = unsupported_reason(model)
        backend = "native" if reason is None else "hf"
        if reason is not None:
            logger.info("rollout.backend=auto: hf (the native decoder cannot run this model: %s)",
                        reason)
    if backend not in MODEL_BACKENDS:
        raise ValueError(f"rollout.backend: {backend!r} is not one of auto, "
                         f"{', '.join(MODEL_BACKENDS)}")
    return MODEL_BACKENDS[backend](model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                   stop_token_ids=stop_token_ids)


def native_can_share(backend: str, model: torch.nn.Module) -> bool:
    """Whether the native decoder can generate with `model` itself: the backend is native (or
    auto picking it) and the model is a plain supported HF model (not LoRA-wrapped, which
    needs merged weights)."""
    return backend in ("native", "auto") and unsupported_reason(model) is None


def build_rollout(cfg: Config, load_model: Callable[[], torch.nn.Module], device: torch.device,
                  *, eos_token_id: int, pad_token_id: int,
                  actor_model: torch.nn.Module | None = None,
                  extra_stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
    """The engine `rollout.backend` names. `load_model` gives a fresh copy of the policy (used
    by the in-process backends; vLLM loads `model.path` itself, servers hold their own).
    `actor_model`: the whole (unsharded) trained model, which the native decoder then reads in
    place instead of holding a copy (see `native_can_share`). `extra_stop_token_ids`: stops
    beside EOS and rollout.stop_token_ids (a multi-turn tool-call format's)."""
    stop = list(dict.fromkeys([*cfg.rollout.stop_token_ids, *extra_stop_token_ids]))
    if cfg.rollout.backend == "server":
        return ServerRollout(ServerSettings.from_config(cfg), eos_token_id=eos_token_id,
                             pad_token_id=pad_token_id, stop_token_ids=stop)
    if cfg.rollout.backend == "vllm":
        return VLLMRollout(VLLMSettings.from_config(cfg), device, eos_token_id=eos_token_id,
                           pad_token_id=pad_token_id, stop_token_ids=stop)
    if actor_model is not None and native_can_share(cfg.rollout.backend, actor_model):
        return NativeRollout(actor_model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                             stop_token_ids=stop, shared=True)
    return model_rollout(cfg.rollout.backend, load_model(), eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, stop_token_ids=stop)


__all__ = ["MODEL_BACKENDS", "GenerationOutput", "RolloutEngine", "SamplingParams",
           "build_rollout", "model_rollout"]
