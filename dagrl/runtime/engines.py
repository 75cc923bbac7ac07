"""The models and services one worker hosts, built only for the roles its plan runs.

Actor, rollout generator and reference share the worker's device; the generator's weights are
refreshed from the actor when the actor has changed since the last sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from dagrl.config.schema import Config
from dagrl.engines.actor import ActorEngine
from dagrl.engines.generator import Generator
from dagrl.engines.models import load_model, load_tokenizer
from dagrl.rewards.manager import RewardManager


@dataclass
class Engines:
    tokenizer: object
    actor: ActorEngine | None = None
    generator: Generator | None = None
    ref_model: torch.nn.Module | None = None
    reward_manager: RewardManager | None = None
    log: Callable[[str], None] = field(default=print)

    def sync_rollout_weights(self) -> float:
        """Copy the actor's weights into the generator if they changed; returns seconds spent."""
        if self.generator is None or self.actor is None:
            return 0.0
        if self.generator.weights_version == self.actor.version:
            return 0.0
        start = time.perf_counter()
        self.generator.load_weights(self.actor.full_weights(), self.actor.version)
        return time.perf_counter() - start


def build_engines(cfg: Config, needed: set[str], device: torch.device, *,
                  dp_group: dist.ProcessGroup | None = None,
                  log: Callable[[str], None] = print) -> Engines:
    """Build the engines in `needed` (names from dagrl.dag.roles.ENGINES)."""
    m = cfg.model
    tokenizer = load_tokenizer(m.path, m.gguf_file)
    engines = Engines(tokenizer=tokenizer, log=log)
    if "actor" in needed:
        actor_model = load_model(m.path, m.gguf_file, m.dtype, device)
        engines.actor = ActorEngine(actor_model, cfg.actor, cfg.algorithm,
                                    temperature=cfg.rollout.temperature,
                                    samples_per_prompt=cfg.rollout.n, dp_group=dp_group)
    if "rollout" in needed:
        engines.generator = Generator(load_model(m.path, m.gguf_file, m.dtype, device),
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
        if engines.actor is not None:
            # Both start from the same checkpoint: nothing to sync before the first update.
            engines.generator.weights_version = engines.actor.version
    if "ref" in needed:
        engines.ref_model = load_model(m.path, m.gguf_file, m.dtype, device).eval()
        engines.ref_model.requires_grad_(False)
    if "reward" in needed:
        r = cfg.reward
        engines.reward_manager = RewardManager(on_error=r.on_error, custom_fn=r.custom_fn,
                                               error_score=r.error_score)
    return engines
