"""The models and services one worker hosts, built only for the roles its plan runs, as the
engine layout (engines/layout.py) places them: one small builder per engine.

Actor and reference are FSDP2-sharded over all workers, or (HSDP, trainer.fsdp_shard_size)
over groups of workers and replicated across them (under LoRA the reference is the
actor's own model with its adapters off, engines/lora.py); with tensor / sequence
parallelism they and the critic share one dp x sp x tp mesh (engines/mesh.py). The rollout
engine holds a full, unsharded copy on each worker (generation needs every weight at every
step), except with one worker, where it is built from the actor (the native decoder reads the
actor's own weights). After each actor update every worker takes part in gathering the full
weights, bucket by bucket (engines/weight_sync.py), and the ones that generate copy them into
their rollout engine in place, so no second full copy of the model is held.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dagrl.algorithms.kl_control import AdaptiveKLController, FixedKLController
from dagrl.config.schema import AlgorithmConfig, Config, RewardConfig
from dagrl.data.vision import ImageEncoder
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
from dagrl.engines.layout import EngineLayout
from dagrl.engines.lora import (
    ADAPTER_DIR,
    ReferenceView,
    is_lora,
    plain_copy,
    save_adapter_config,
)
from dagrl.engines.mesh import TrainMesh, build_train_mesh, parallelize_model
from dagrl.engines.model_build import actor_model, reference_model
from dagrl.engines.models import DTYPES, cast_copy, load_model, load_tokenizer, plain_config
from dagrl.engines.reward_model import RewardModelEngine, load_reward_model
from dagrl.engines.sharding import checkpoint_activations, compile_layers, shard_model
from dagrl.envs import load_environment
from dagrl.rewards.manager import RewardManager
from dagrl.rollout import RolloutEngine, build_rollout, judge_rollout
from dagrl.rollout.multi_turn import EngineReplica, MultiTurnRollout
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
    synced_bytes: int = 0     # bytes the last sync handed this rank's rollout engine
    # Where the actor's new weights go after an update: this worker's rollout engine (None), or
    # a channel to the rollout ranks of an async run (engines/weight_channel.WeightSender).
    weight_sink: object | None = None
    logged_once: set[str] = field(default_factory=set)

    def log_once(self, key: str, message: str) -> None:
        """`message` the first time `key` is logged in this run; later ones are counted in the
        metrics and the step line instead (a line per step would bury the progress)."""
        if key not in self.logged_once:
            self.logged_once.add(key)
            self.log(message)

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
        and load them into this worker's rollout engine, or send them to the rollout ranks
        (`weight_sink`). Returns the seconds spent."""
        if self.actor is None or self.synced_version == self.actor.version:
            return 0.0
        seconds = self._load_weights(self.weight_sink if self.weight_sink is not None
                                     else self.rollout)
        self.synced_version = self.actor.version
        return seconds

    def refresh_own_rollout(self) -> float:
        """An async trainer rank's own rollout engine (it validates with it, as a sync rank
        does): the actor's current weights, when it holds older ones. The update's weights went
        to the rollout ranks, not here, so this is one more gather, at validation steps only
        (collective over the trainer ranks)."""
        if (self.weight_sink is None or self.rollout is None or self.actor is None
                or self.rollout.weights_version == self.actor.version):
            return 0.0
        return self._load_weights(self.rollout)

    def _load_weights(self, sink) -> float:
        if getattr(sink, "shared", False):   # generates with the actor's own weights
            sink.weights_version = self.actor.version
            self.synced_bytes = 0
            return 0.0
        start = time.perf_counter()
        counted = _Counted()
        if self.actor.is_lora and getattr(sink, "takes_adapters", False):
            # An engine that applies LoRA adapters itself takes them alone, not merged weights.
            sink.update_adapter(counted(self.actor.adapter_weights()),
                                self.actor.adapter_config(), self.actor.version)
        else:
            # A tensor-parallel engine names the blocks its rank reads (weight_shard).
            shard = getattr(sink, "weight_shard", None)
            weights = counted(self.actor.rollout_weights(shard), shard)
            if sink is not None:
                sink.update_weights(weights, self.actor.version)
            else:
                for _ in weights:   # still take part in every all-gather
                    pass
        self.synced_bytes = counted.bytes
        return time.perf_counter() - start


class _Counted:
    """Counts the bytes of the (name, tensor) pairs handed on (with a tensor-parallel rollout
    engine's `shard`: the blocks its rank reads, not the whole-shaped tensors carrying them)."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, named, shard=None):
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, tensor in named:
            region = shard.block(name, tuple(tensor.shape), rank) if shard else ()
            self.bytes += tensor[region].numel() * tensor.element_size()
            yield name, tensor


def build_engines(cfg: Config, needed: set[str], device: torch.device, *,
                  world_size: int = 1, log: Callable[[str], None] = print,
                  tokenizer=None, dp_group: dist.ProcessGroup | None = None,
                  layout: EngineLayout | None = None, handed_prompts: bool = False,
                  hsdp_mesh: DeviceMesh | None = None,
                  train_mesh: TrainMesh | None = None,
                  engine_replica: EngineReplica | None = None) -> Engines:
    """Build the engines in `needed` (names from dagrl.roles.registry.ENGINES) as `layout`
    places them (engines/layout.py; default: a sync run of `world_size` ranks); `dp_group`:
    the group of `layout.side_ranks` when not all of them (trainer.mode=async: this side's
    ranks). `tokenizer`: the run's, when the caller has loaded it already (the worker does,
    for its pre-flight). `handed_prompts`: the model's prompts are another policy's answers (an
    extra model's, made by a handoff node), so data.max_prompt_length does not bound them.
    `hsdp_mesh` / `train_mesh`: an async trainer side's HSDP mesh or training mesh (tensor /
    sequence parallelism), made beforehand by every rank (sharding.hsdp_mesh,
    mesh.build_train_mesh with the side's ranks). `engine_replica`: the ranks this rank drives
    a tensor-parallel rollout engine with (the agent loop's answers are its first rank's)."""
    if layout is None:
        layout = EngineLayout.of(cfg, world_size, device_type=device.type)
    _prepare_host(cfg, layout, device)
    build = _Build(cfg, layout, device, needed, dp_group, hsdp_mesh, train_mesh)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.gguf_file)
    engines = Engines(tokenizer=tokenizer, log=log)
    if "actor" in needed:
        engines.actor = build.actor()
    if "critic" in needed:
        engines.critic = build.critic()
    if "rollout" in needed:
        engines.rollout, engines.agent = build.rollout(tokenizer, engines.actor, handed_prompts,
                                                       engine_replica)
    if "ref" in needed:
        engines.ref_model = build.reference(engines.actor)
    if "reward" in needed:
        engines.reward_manager = reward_manager(cfg.reward)
    if "reward_model" in needed:
        engines.reward_model = build.reward_model()
    if "judge" in needed:
        engines.judge = build.judge()
    engines.kl_controller = kl_controller(cfg.algorithm)
    return engines


def _with_model_context(cfg: Config) -> Config:
    """`cfg` with rollout.vllm.max_model_len the model's own context window. vLLM fixes its
    context at start, by default to data.max_prompt_length + rollout.max_new_tokens; prompts
    handed on from another policy's answers are longer than the dataset's ('maximum context
    length is 38 tokens. However, your prompt contains 63 input tokens')."""
    from transformers import AutoConfig

    window = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True
                                        ).get_text_config().max_position_embeddings
    vllm = dataclasses.replace(cfg.rollout.vllm, max_model_len=window)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm=vllm))


def _prepare_host(cfg: Config, layout: EngineLayout, device: torch.device) -> None:
    """CPU workers, before any model is allocated: how malloc keeps and maps memory
    (engines/host_memory.py)."""
    if not is_host(device):
        return
    if cfg.trainer.keep_freed_memory:
        keep_freed_memory()
    if cfg.trainer.trim_host_memory:    # large blocks mapped on their own: no fragmentation
        map_large_blocks(LARGE_BLOCK if layout.mixed_precision == "none"
                         else LARGE_BLOCK_MIXED_PRECISION)


class _Build:
    """One build_engines call: the config, the layout bound to this process's data-parallel
    group, the device and, under tensor / sequence parallelism, the training mesh (made here:
    a collective over the ranks). One method per engine."""

    def __init__(self, cfg: Config, layout: EngineLayout, device: torch.device,
                 needed: set[str], shard_group: dist.ProcessGroup | None,
                 hsdp_mesh: DeviceMesh | None = None,
                 train_mesh: TrainMesh | None = None) -> None:
        self.cfg, self.device = cfg, device
        self.shard_group = shard_group      # None: all ranks
        self.hsdp_mesh = hsdp_mesh          # HSDP over a subgroup (async trainer side)
        if train_mesh is None and layout.mesh and needed & MESH_ENGINES:
            train_mesh = build_train_mesh(layout.side_size, layout.tp, layout.sp, device.type,
                                          layout.fsdp_shard_size)
        self.mesh = train_mesh if layout.mesh else None
        if self.mesh is not None:   # sums over the replicas; gradients averaged over dp x sp
            dp_group = self.mesh.dp_group
        else:
            world = shard_group if shard_group is not None else dist.group.WORLD
            dp_group = world if layout.side_size > 1 else None
        self.layout = layout.with_dp_group(dp_group)

    def load(self, dtype: str = "") -> torch.nn.Module:
        m = self.cfg.model
        return load_model(m.path, m.gguf_file, dtype or self.layout.param_dtype, self.device,
                          m.attn_implementation)

    def shard(self, model: torch.nn.Module, name: str) -> torch.nn.Module:
        """`name`'s model on the training mesh, or FSDP2 over the side's ranks (HSDP over
        groups of layout.fsdp_shard_size), its shards in host memory if the layout offloads
        it; a no-op for one rank."""
        offload = name in self.layout.offload
        if self.mesh is not None:
            return parallelize_model(model, self.mesh, offload)
        return shard_model(model, self.layout.side_size, self.device.type,
                           self.layout.fsdp_shard_size, group=self.shard_group, offload=offload,
                           mesh=self.hsdp_mesh)

    def actor(self) -> ActorEngine:
        cfg = self.cfg
        model = actor_model(self.load(), self.layout, cfg.actor.lora)
        if cfg.actor.activation_checkpointing:
            checkpoint_activations(model)
        if cfg.actor.compile:
            compile_layers(model)
        return ActorEngine(self.shard(model, "actor"), cfg.actor, cfg.algorithm, self.layout,
                           temperature=logprob_temperature(cfg.rollout.temperature))

    def critic(self) -> CriticEngine:
        cfg, m = self.cfg, self.cfg.model
        model = load_value_model(cfg.critic.path or m.path, self.layout.param_dtype, self.device,
                                 m.attn_implementation)
        if cfg.critic.activation_checkpointing:
            checkpoint_activations(model)
        return CriticEngine(self.shard(model, "critic"), cfg.critic, self.layout,
                            loss_agg_mode=cfg.algorithm.loss_agg_mode)

    def rollout(self, tokenizer, actor: ActorEngine | None, handed_prompts: bool = False,
                replica: EngineReplica | None = None
                ) -> tuple[RolloutEngine, MultiTurnRollout | None]:
        """The rollout engine (it starts from the actor's checkpoint: nothing to sync before the
        first update) and, with rollout.multi_turn, the agent loop over it (prompts as wide as
        the batch's longest when they are handed on from another policy)."""
        cfg = self.cfg
        if handed_prompts and cfg.rollout.backend == "vllm" and not cfg.rollout.vllm.max_model_len:
            cfg = _with_model_context(cfg)
        # One worker: the copy is built from the whole actor (or is the actor itself).
        whole = actor.model if actor is not None and self.layout.whole_actor else None
        mt = cfg.rollout.multi_turn
        stops = MultiTurnRollout.format_stop_token_ids(tokenizer, mt.format) if mt.enable else []
        engine = build_rollout(cfg, functools.partial(self.rollout_copy, whole), self.device,
                               eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id,
                               actor_model=whole if self.layout.rollout_copy == "shared" else None,
                               extra_stop_token_ids=stops)
        if not mt.enable:
            return engine, None
        return engine, MultiTurnRollout(
            engine, tokenizer, mt, tools=load_tools(mt.tools, mt),
            env_factory=load_environment(mt.environment) if mt.environment else None,
            prompt_width=None if handed_prompts else cfg.data.max_prompt_length,
            response_width=cfg.rollout.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            replica=replica, images=ImageEncoder.of_model(cfg.model.path, tokenizer))

    def rollout_copy(self, whole_actor: torch.nn.Module | None) -> torch.nn.Module:
        """The rollout engine's own weights (layout.rollout_copy): loaded in the rollout dtype,
        or built from the whole actor with no second load. Under LoRA only the merged adapted
        linears get storage (`plain_copy`), unless mixed precision casts every weight."""
        dtype = self.layout.rollout_dtype
        if whole_actor is None:
            return self.load(dtype)
        if is_lora(whole_actor):
            plain = plain_copy(whole_actor)
            return plain if dtype == self.layout.param_dtype else cast_copy(plain, DTYPES[dtype])
        return cast_copy(whole_actor, DTYPES[dtype])

    def reference(self, actor: ActorEngine | None):
        """Under LoRA the frozen base: the actor with its adapters off; else a model of its
        own, sharded like the actor."""
        if self.layout.ref_is_actor and actor is not None:
            return ReferenceView(actor.model)
        ref = reference_model(self.load(), self.layout)
        if self.cfg.actor.compile:
            compile_layers(ref)
        return self.shard(ref, "ref")

    def reward_model(self) -> RewardModelEngine:
        """FSDP2 / HSDP over the side's workers (no tp/sp), never trained."""
        rm = self.cfg.reward_model
        model = load_reward_model(rm.path, rm.dtype, self.device,
                                  self.cfg.model.attn_implementation)
        return RewardModelEngine(
            shard_model(model, self.layout.side_size, self.device.type,
                        self.layout.fsdp_shard_size, group=self.shard_group),
            load_tokenizer(rm.path), micro_batch_size=rm.micro_batch_size,
            max_length=rm.max_length, device=self.device)

    def judge(self) -> Judge:
        """A whole copy per rank in an in-process rollout engine, or servers serving it."""
        j = self.cfg.judge
        tokenizer = load_tokenizer(j.path, j.gguf_file)

        def load() -> torch.nn.Module:
            return load_model(j.path, j.gguf_file, j.dtype, self.device,
                              self.cfg.model.attn_implementation).eval()

        engine = judge_rollout(j, load, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
        return Judge(j, engine, tokenizer, self.device)


def reward_manager(r: RewardConfig) -> RewardManager:
    return RewardManager(on_error=r.on_error, custom_fn=r.custom_fn, error_score=r.error_score,
                         scorer=r.scorer, num_workers=r.num_workers, timeout_s=r.timeout_s)


def kl_controller(algo: AlgorithmConfig) -> FixedKLController | AdaptiveKLController | None:
    """The KL-in-reward coefficient's controller (None without algorithm.kl_in_reward)."""
    if not algo.kl_in_reward:
        return None
    if algo.kl_ctrl == "adaptive":
        return AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
    return FixedKLController(algo.kl_coef)
