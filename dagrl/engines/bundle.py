"""The models and services one worker hosts, built only for the roles its plan runs.

Actor and reference are FSDP2-sharded over all workers, or (HSDP, trainer.fsdp_shard_size)
over groups of workers and replicated across them (under LoRA the reference is the
actor's own model with its adapters off, engines/lora.py); with tensor / sequence
parallelism they and the critic share one dp x sp x tp mesh (engines/mesh.py). The rollout
engine holds a full, unsharded copy on each worker (generation needs every weight at every
step), except with one worker and the native decoder, which then reads the actor's own
weights. After each actor update every worker takes part in gathering the full weights, bucket
by bucket (engines/weight_sync.py), and the ones that generate copy them into their rollout
engine in place, so no second full copy of the model is held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dagrl.algorithms.kl_control import AdaptiveKLController, FixedKLController
from dagrl.config.schema import Config
from dagrl.device import is_host
from dagrl.engines.actor import ActorEngine
from dagrl.engines.critic import CriticEngine, load_value_model
from dagrl.engines.host_memory import (
    LARGE_BLOCK,
    LARGE_BLOCK_MIXED_PRECISION,
    keep_freed_memory,
    map_large_blocks,
)
from dagrl.engines.judge import Judge
from dagrl.engines.lora import (
    ADAPTER_DIR,
    ReferenceView,
    apply_lora,
    is_lora,
    plain_copy,
    save_adapter_config,
)
from dagrl.engines.mesh import build_train_mesh, parallelize_model
from dagrl.engines.models import DTYPES, cast_copy, load_model, load_tokenizer, plain_config
from dagrl.engines.precision import store_linears_in_low_precision
from dagrl.engines.reward_model import RewardModelEngine, load_reward_model
from dagrl.engines.sharding import checkpoint_activations, compile_layers, shard_model
from dagrl.envs import load_environment
from dagrl.rewards.manager import RewardManager
from dagrl.rollout import RolloutEngine, build_rollout, model_rollout
from dagrl.rollout.multi_turn import MultiTurnRollout
from dagrl.rollout.sampling import logprob_temperature
from dagrl.tools import load_tools

# The engines whose models live on the training mesh (tensor / sequence parallelism).
MESH_ENGINES = frozenset({"actor", "ref", "critic"})


@dataclass
class Engines:
    tokenizer: object
    actor: ActorEngine | None = None
    critic: CriticEngine | None = None
    rollout: RolloutEngine | None = None
    # rollout.multi_turn: the agent loop over `rollout` (tools, environments).
    agent: MultiTurnRollout | None = None
    ref_model: torch.nn.Module | None = None
    reward_manager: RewardManager | None = None
    reward_model: RewardModelEngine | None = None
    judge: Judge | None = None
    kl_controller: FixedKLController | AdaptiveKLController | None = None
    log: Callable[[str], None] = field(default=print)
    synced_version: int = 0   # the actor version the rollout engines hold (the same on every rank)

    def write_hf_files(self, out: Path) -> None:
        """What `dagrl export` needs beside a checkpoint's weights: the actor's model config
        (without a GGUF quantization_config), its LoRA adapter config, and the tokenizer."""
        model = self.actor.model if self.actor else None
        if model is not None:
            plain_config(model.config).save_pretrained(out)
            if is_lora(model):
                save_adapter_config(model, out.parent / ADAPTER_DIR)
        self.tokenizer.save_pretrained(out)

    def sync_rollout_weights(self) -> float:
        """After an update: gather the actor's full weights (collective over the actor's ranks)
        and load them into this worker's rollout engine. Returns the seconds spent."""
        if self.actor is None or self.synced_version == self.actor.version:
            return 0.0
        if getattr(self.rollout, "shared", False):   # generates with the actor's own weights
            self.rollout.weights_version = self.synced_version = self.actor.version
            return 0.0
        start = time.perf_counter()
        weights = self.actor.full_weights()
        if self.rollout is not None:
            self.rollout.update_weights(weights, self.actor.version)
        else:
            for _ in weights:   # still take part in every all-gather
                pass
        self.synced_version = self.actor.version
        return time.perf_counter() - start


def build_engines(cfg: Config, needed: set[str], device: torch.device, *,
                  world_size: int = 1, log: Callable[[str], None] = print,
                  tokenizer=None, dp_group: dist.ProcessGroup | None = None) -> Engines:
    """Build the engines in `needed` (names from dagrl.roles.registry.ENGINES); `tokenizer`:
    the run's, when the caller has loaded it already (the worker does, for its pre-flight);
    `dp_group`: the ranks the trained models are sharded over when not all of them
    (trainer.mode=async: the trainer ranks; `world_size` is then their number)."""
    m = cfg.model
    if is_host(device):                 # before any model is allocated (host_memory.py)
        if cfg.trainer.keep_freed_memory:
            keep_freed_memory()
        if cfg.trainer.trim_host_memory:    # large blocks mapped on their own: no fragmentation
            map_large_blocks(LARGE_BLOCK if m.mixed_precision == "none"
                             else LARGE_BLOCK_MIXED_PRECISION)

    def load(dtype: str = m.dtype) -> torch.nn.Module:
        return load_model(m.path, m.gguf_file, dtype, device, m.attn_implementation)

    a = cfg.actor
    parallel = a.model_parallel_size > 1 and world_size > 1
    # Tensor / sequence parallelism: one (dp, sp, tp) mesh for the actor, reference and critic.
    mesh = (build_train_mesh(world_size, a.tensor_parallel_size, a.sequence_parallel_size,
                             device.type) if parallel and needed & MESH_ENGINES else None)

    shard_group = dp_group   # None: all ranks (dp_group is rebound below)

    def shard(model: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
        if mesh is not None:    # the config refuses offload here
            return parallelize_model(model, mesh)
        # FSDP2 over all workers (or the async trainer ranks), or HSDP over groups of
        # trainer.fsdp_shard_size (tp = sp = 1, sync only); `offload`: shards in host memory
        return shard_model(model, world_size, device.type, cfg.trainer.fsdp_shard_size,
                           group=shard_group, offload=offload)

    if tokenizer is None:
        tokenizer = load_tokenizer(m.path, m.gguf_file)
    engines = Engines(tokenizer=tokenizer, log=log)
    # Samples per optimizer step on each rank: the mini-batch over the ranks that train (per
    # tensor/sequence-parallel replica; trainer.mode=async: over the trainer ranks, and
    # tensor/sequence parallelism is refused there by the config).
    mini_batch_samples = (cfg.mini_batch_samples_per_rank if dp_group is None else
                          cfg.actor.mini_batch_size * cfg.rollout.n // world_size)
    if mesh is not None:   # sums over the replicas; gradients averaged over dp x sp ranks
        dp_group, grad_scale = mesh.dp_group, mesh.fsdp_size
    elif dp_group is None:
        dp_group, grad_scale = (dist.group.WORLD if world_size > 1 else None), 0
    else:
        dp_group, grad_scale = (dp_group if world_size > 1 else None), 0
    if "actor" in needed:
        actor_model = load()
        lora = a.lora
        if lora.rank:
            actor_model = apply_lora(actor_model, lora.rank, lora.alpha, lora.target_modules,
                                     lora.dropout)
        if cfg.actor.activation_checkpointing:
            checkpoint_activations(actor_model)
        if cfg.actor.compile:
            compile_layers(actor_model)
        engines.actor = ActorEngine(shard(actor_model, cfg.actor.offload), cfg.actor,
                                    cfg.algorithm,
                                    temperature=logprob_temperature(cfg.rollout.temperature),
                                    mini_batch_samples=mini_batch_samples,
                                    pack_sequences=m.pack_sequences,
                                    mixed_precision=m.mixed_precision, dp_group=dp_group,
                                    grad_scale=grad_scale)
    if "critic" in needed:
        critic_model = load_value_model(cfg.critic.path or m.path, m.dtype, device,
                                        m.attn_implementation)
        engines.critic = CriticEngine(shard(critic_model, cfg.critic.offload), cfg.critic,
                                      loss_agg_mode=cfg.algorithm.loss_agg_mode,
                                      mini_batch_samples=mini_batch_samples,
                                      pack_sequences=m.pack_sequences,
                                      mixed_precision=m.mixed_precision, dp_group=dp_group,
                                      grad_scale=grad_scale)
    if "rollout" in needed:
        # Starts from the same checkpoint as the actor: nothing to sync before the first update.
        # One worker: the native decoder reads the actor's own (whole) weights, no copy,
        # unless the rollout runs in another dtype (mixed precision).
        whole_actor = engines.actor.model if engines.actor and world_size == 1 else None
        dtype = m.rollout_dtype

        def load_rollout_copy() -> torch.nn.Module:
            if whole_actor is None:
                return load(dtype)
            # Built from the whole actor, with no second load. Under LoRA the copy holds only
            # the merged adapted linears and shares the actor's frozen tensors, unless mixed
            # precision wants every weight cast to bfloat16.
            if is_lora(whole_actor):
                plain = plain_copy(whole_actor)
                return plain if dtype == m.dtype else cast_copy(plain, DTYPES[dtype])
            return cast_copy(whole_actor, DTYPES[dtype])

        mt = cfg.rollout.multi_turn
        format_stops = (MultiTurnRollout.format_stop_token_ids(tokenizer, mt.format)
                        if mt.enable else [])
        engines.rollout = build_rollout(cfg, load_rollout_copy, device,
                                        eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.pad_token_id,
                                        actor_model=whole_actor if dtype == m.dtype else None,
                                        extra_stop_token_ids=format_stops)
        if mt.enable:
            engines.agent = MultiTurnRollout(
                engines.rollout, tokenizer, mt, tools=load_tools(mt.tools, mt),
                env_factory=load_environment(mt.environment) if mt.environment else None,
                prompt_width=cfg.data.max_prompt_length,
                response_width=cfg.rollout.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    if "ref" in needed and cfg.actor.lora.rank and engines.actor is not None:
        # Under LoRA the reference is the frozen base: the actor with its adapters off.
        engines.ref_model = ReferenceView(engines.actor.model)
    elif "ref" in needed:
        ref = store_linears_in_low_precision(load().eval().requires_grad_(False),
                                             m.mixed_precision)
        if cfg.actor.compile:
            compile_layers(ref)
        engines.ref_model = shard(ref, cfg.ref.offload)
    if "reward" in needed:
        r = cfg.reward
        engines.reward_manager = RewardManager(on_error=r.on_error, custom_fn=r.custom_fn,
                                               error_score=r.error_score, scorer=r.scorer,
                                               num_workers=r.num_workers, timeout_s=r.timeout_s)
    if "reward_model" in needed:   # FSDP2 / HSDP over the workers (no tp/sp), never trained
        rm = cfg.reward_model
        engines.reward_model = RewardModelEngine(
            shard_model(load_reward_model(rm.path, rm.dtype, device, m.attn_implementation),
                        world_size, device.type, cfg.trainer.fsdp_shard_size),
            load_tokenizer(rm.path), micro_batch_size=rm.micro_batch_size,
            max_length=rm.max_length, device=device)
    if "judge" in needed:   # a whole copy per rank, like the rollout engine
        j = cfg.judge
        judge_tokenizer = load_tokenizer(j.path, j.gguf_file)
        engine = model_rollout(j.backend, load_model(j.path, j.gguf_file, j.dtype, device,
                                                     m.attn_implementation).eval(),
                               eos_token_id=judge_tokenizer.eos_token_id,
                               pad_token_id=judge_tokenizer.pad_token_id)
        engines.judge = Judge(j, engine, judge_tokenizer)
    algo = cfg.algorithm
    if algo.kl_in_reward:
        engines.kl_controller = (AdaptiveKLController(algo.kl_coef, algo.kl_target,
                                                      algo.kl_horizon)
                                 if algo.kl_ctrl == "adaptive" else FixedKLController(algo.kl_coef))
    return engines
