"""The models and services one worker hosts, built only for the roles its plan runs.

Actor and reference are FSDP2-sharded over all workers; the rollout generator is a full,
unsharded copy on each worker (generation needs every weight at every step). After each actor
update every worker takes part in gathering the full weights, bucket by bucket
(engines/weight_sync.py), and the ones that generate copy them into their generator in place,
so no second full copy of the model is held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dagrl.algorithms.kl_control import AdaptiveKLController, FixedKLController
from dagrl.config.schema import Config
from dagrl.engines.actor import ActorEngine
from dagrl.engines.critic import CriticEngine, load_value_model
from dagrl.engines.generator import Generator
from dagrl.engines.models import load_model, load_tokenizer
from dagrl.engines.sharding import compile_layers, shard_model
from dagrl.rewards.manager import RewardManager


@dataclass
class Engines:
    tokenizer: object
    actor: ActorEngine | None = None
    critic: CriticEngine | None = None
    generator: Generator | None = None
    ref_model: torch.nn.Module | None = None
    reward_manager: RewardManager | None = None
    kl_controller: FixedKLController | AdaptiveKLController | None = None
    log: Callable[[str], None] = field(default=print)
    synced_version: int = 0   # the actor version the generators hold (the same on every rank)

    def sync_rollout_weights(self) -> float:
        """After an update: gather the actor's full weights (collective over the actor's ranks)
        and load them into this worker's generator. Returns the seconds spent."""
        if self.actor is None or self.synced_version == self.actor.version:
            return 0.0
        start = time.perf_counter()
        weights = self.actor.full_weights()
        if self.generator is not None:
            self.generator.load_weights(weights, self.actor.version)
        else:
            for _ in weights:   # still take part in every all-gather
                pass
        self.synced_version = self.actor.version
        return time.perf_counter() - start


def build_engines(cfg: Config, needed: set[str], device: torch.device, *,
                  world_size: int = 1, log: Callable[[str], None] = print) -> Engines:
    """Build the engines in `needed` (names from dagrl.dag.roles.ENGINES)."""
    m = cfg.model

    def load() -> torch.nn.Module:
        return load_model(m.path, m.gguf_file, m.dtype, device, m.attn_implementation)

    tokenizer = load_tokenizer(m.path, m.gguf_file)
    engines = Engines(tokenizer=tokenizer, log=log)
    if "actor" in needed:
        actor_model = load()
        if cfg.actor.compile:
            compile_layers(actor_model)
        actor_model = shard_model(actor_model, world_size, device.type)
        engines.actor = ActorEngine(actor_model, cfg.actor, cfg.algorithm,
                                    temperature=cfg.rollout.temperature,
                                    samples_per_prompt=cfg.rollout.n,
                                    dp_group=dist.group.WORLD if world_size > 1 else None)
    if "critic" in needed:
        critic_model = load_value_model(cfg.critic.path or m.path, m.dtype, device,
                                        m.attn_implementation)
        engines.critic = CriticEngine(shard_model(critic_model, world_size, device.type),
                                      cfg.critic, cfg.actor,
                                      loss_agg_mode=cfg.algorithm.loss_agg_mode,
                                      samples_per_prompt=cfg.rollout.n,
                                      dp_group=dist.group.WORLD if world_size > 1 else None)
    if "rollout" in needed:
        # Starts from the same checkpoint as the actor: nothing to sync before the first update.
        engines.generator = Generator(load(),
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id,
                                      stop_token_ids=cfg.rollout.stop_token_ids)
    if "ref" in needed:
        ref = load().eval().requires_grad_(False)
        if cfg.actor.compile:
            compile_layers(ref)
        engines.ref_model = shard_model(ref, world_size, device.type)
    if "reward" in needed:
        r = cfg.reward
        engines.reward_manager = RewardManager(on_error=r.on_error, custom_fn=r.custom_fn,
                                               error_score=r.error_score)
    a = cfg.algorithm
    if a.kl_in_reward:
        engines.kl_controller = (AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
                                 if a.kl_ctrl == "adaptive" else FixedKLController(a.kl_coef))
    return engines
