"""`rollout.backend=auto` (the default): the native decoder when it can run the model, else hf.

Which one is decided by the model (native_decoder.py's `fast_path_unsupported`), so only when
the engine is built; until then auto declares what both share, and `shares_actor_weights` as
native does (the case of every model the native decoder supports).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from dagrl.config.schema import Config
from dagrl.rollout.base import ModelCopy, RolloutBackend, RolloutBuild, RolloutEngine
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout, unsupported_reason
from dagrl.rollout.registry import ROLLOUT_BACKENDS

logger = logging.getLogger(__name__)


@ROLLOUT_BACKENDS.register("auto")
class AutoRollout(RolloutBackend):
    """Resolves to `NativeRollout` or `HFRollout` for the model at hand."""

    # Both generate in this process with the trainer's numerics and take weights in place.
    trainer_numerics = True
    # Native reads the actor's weights when it supports the model (hf then never runs).
    shares_actor_weights = NativeRollout.shares_actor_weights
    # An image-text model is not one the native decoder runs: hf generates for it.
    generates_from_images = HFRollout.generates_from_images

    @staticmethod
    def resolve(model: torch.nn.Module) -> type[ModelCopy]:
        """The backend for `model`: native when its decoder can run it, else hf."""
        reason = unsupported_reason(model)
        if reason is None:
            return NativeRollout
        logger.info("rollout.backend=auto: hf (the native decoder cannot run this model: %s)",
                    reason)
        return HFRollout

    @classmethod
    def from_config(cls, cfg: Config, build: RolloutBuild) -> RolloutEngine:
        actor = build.actor_model
        if actor is not None and unsupported_reason(actor) is None:
            return NativeRollout.from_config(cfg, build)   # over the actor's own weights
        return super().from_config(cfg, build)   # a fresh copy, then native or hf for it

    @classmethod
    def over_model(cls, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                   stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
        return cls.resolve(model).over_model(model, eos_token_id=eos_token_id,
                                             pad_token_id=pad_token_id,
                                             stop_token_ids=stop_token_ids)
