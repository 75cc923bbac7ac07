"""How a worker is built (runtime/worker.py): once, before its first step, in the order that
reports a bad input soonest. Its data (the rank's prompt shard, checked with the tokenizer alone),
then its engines (one layout for the side, read by the build as `dagrl plan --memory` reads it;
activation checkpointing decided on the estimated peak), then its batch source and sink for the
placement: sync, or an async rollout or trainer side (runtime/streams.py).
"""

from __future__ import annotations

from dagrl.config.loader import ConfigError
from dagrl.config.models import model_config
from dagrl.config.schema import Config
from dagrl.dag.planner import RankPlan
from dagrl.data.dataset import PromptLoader
from dagrl.data.parquet import ParquetPrompts
from dagrl.data.vision import ImageEncoder
from dagrl.engines.bundle import build_engines
from dagrl.engines.checkpointing_choice import (
    checkpointing_needed,
    describe_choice,
    peak_and_room,
    with_checkpointing,
)
from dagrl.engines.layout import EngineLayout
from dagrl.engines.memory_estimate import (
    ModelShape,
    estimate_memory,
    estimated_peak,
    model_shape,
    other_model_lines,
    other_model_shapes,
)
from dagrl.engines.mesh import build_train_mesh
from dagrl.engines.models import DTYPES, load_tokenizer
from dagrl.engines.sharding import hsdp_mesh
from dagrl.engines.weight_channel import WeightSender, policy_tag
from dagrl.observe.memory import GB, host_rss_bytes
from dagrl.roles.plan import engines_of
from dagrl.roles.registry import ROLES
from dagrl.rollout import rollout_backend
from dagrl.rollout.multi_turn import EngineReplica
from dagrl.rollout.versioned import VersionedRollout
from dagrl.runtime.distributed import position_in_replica
from dagrl.runtime.preflight import check_prompts
from dagrl.runtime.streams import (
    FreshWeightsPromptSource,
    GroupSink,
    GroupSource,
    MetricsSink,
    PromptSource,
)


def check_rollout_on_every_rank(plans: list[RankPlan], backend: str) -> None:
    """A backend whose engines join the process group when they start (vLLM's) needs every
    rank to build one: a rank without the rollout node would leave the others waiting."""
    missing = [p.rank for p in plans if "rollout" not in engines_of(p)]
    if missing:
        raise ValueError(f"rollout.backend={backend} with several workers needs the rollout node "
                         f"on every rank (its engines join the process group when they start); "
                         f"ranks {missing} have none (drop the node's options.ranks)")


class WorkerBuild:
    """The Worker's build methods (a part of the Worker, kept in its own file): its `__init__`
    calls them in turn."""

    def _open_data(self, validates: bool) -> tuple:
        """(tokenizer, train loader, validation source): the ranks that read prompts read their
        shard of the side's; pre-flight checks what needs only the tokenizer (batch
        divisibility, prompt lengths) before minutes of model loading."""
        d = self.cfg.data
        tokenizer = load_tokenizer(self.cfg.model.path, self.cfg.model.gguf_file)
        images = ImageEncoder.of_model(self.cfg.model.path, tokenizer)
        loaders, loader, val_source = {}, None, None
        if self.placement.reads_prompts:
            loader = loaders["train"] = PromptLoader(
                ParquetPrompts(d.train_files, d.prompt_key,
                               max_image_pixels=d.max_image_pixels), tokenizer,
                batch_size=d.train_batch_size, rank=self.side.index, world_size=self.side.size,
                seed=self.cfg.trainer.seed, shuffle=d.shuffle, tail=d.tail,
                max_prompt_length=d.max_prompt_length, truncation=d.truncation, images=images)
        if validates:
            val_source = ParquetPrompts(d.val_files, d.prompt_key, config_key="data.val_files",
                                        max_image_pixels=d.max_image_pixels)
            loaders["val"] = PromptLoader(val_source, tokenizer, batch_size=1, tail="pad",
                                          max_prompt_length=d.max_prompt_length,
                                          truncation=d.truncation, images=images)
        check_prompts(loaders, self.log)
        return tokenizer, loader, val_source

    def _build_engines(self, needed: set[str], tokenizer) -> None:
        """This side's engines; in async mode the trained models shard over the side's ranks."""
        cfg, side, kind = self.cfg, self.side, self.placement.kind
        # One layout, computed once for this rank's side (engines/layout.py): the build reads it
        # as `dagrl plan --memory` does.
        self.layout = EngineLayout.of(cfg, self.world_size,
                                      side_ranks=side.ranks if kind != "all" else None,
                                      side=kind if kind != "all" else None,
                                      device_type=self.device.type)
        # Every rank makes the trainer side's meshes; the trainer ranks build on them.
        hsdp, mesh = self._trainer_meshes()
        trains = kind == "trainer"
        replica = self._engine_replica()
        self.engines = build_engines(cfg, needed, self.device, layout=self.layout, log=self.log,
                                     tokenizer=tokenizer,
                                     dp_group=side.group if kind != "all" else None,
                                     hsdp_mesh=hsdp if trains else None,
                                     train_mesh=mesh if trains else None,
                                     engine_replica=replica)
        # The config's extra policies (config/models.py), each with its own engines, placed as
        # the main policy's (async: this side's, on the same meshes); their prompts are made
        # from the main policy's answers (a handoff node).
        self.model_engines = {}
        for name in cfg.models:
            own = model_config(cfg, name)
            if own.actor.activation_checkpointing == "auto":
                own = self._choose_checkpointing(own, self.engines_needed(own, name),
                                                 host_rss_bytes())
            layout = EngineLayout.of(own, self.world_size, side_ranks=self.layout.side_ranks,
                                     side=self.layout.side, device_type=self.device.type
                                     ) if kind != "all" else None
            self.model_engines[name] = build_engines(
                own, self.engines_needed(own, name), self.device,
                world_size=self.world_size, log=self.log, handed_prompts=True, layout=layout,
                dp_group=side.group if kind != "all" else None,
                hsdp_mesh=hsdp if trains else None, train_mesh=mesh if trains else None,
                engine_replica=replica)

    def _engine_replica(self) -> EngineReplica | None:
        """Under rollout tensor parallelism, the ranks of this rank's engine (the planner's
        rollout layout): their agent loops take its first rank's tool answers."""
        tp = rollout_backend(self.cfg).ranks_per_engine(self.cfg)
        task = next((t for t in self.tasks if t.kind == "node" and t.group == tp > 1
                     and "rollout" in ROLES.get(t.role).engines), None)
        if task is None:
            return None
        replicas = self.dist.replicas_of(task.dst, task.group)
        first = self.rank - position_in_replica(self.rank, task.dst, task.group)
        return EngineReplica(replicas.replica_group, leader=first, leads=first == self.rank)

    def engines_needed(self, cfg: Config, model: str) -> set[str]:
        """The engines this rank builds for policy `model` ('' the main one; `cfg` its
        config): those its nodes use, on its side; and a rollout engine that joins the process
        group when it starts (a collective of every rank) on an async trainer rank too (the
        main policy's validates with it)."""
        needed = self.placement.engines(engines_of(self.plan, model))
        joins = rollout_backend(cfg).joins_process_group and self.world_size > 1
        if joins and self.placement.kind == "trainer":
            needed |= {"rollout"}
        return needed

    def _trainer_meshes(self) -> tuple:
        """Async: the trainer side's (replicate, shard) mesh under HSDP, or its training mesh
        under tensor / sequence parallelism, made here by every rank (their process groups are
        made by all ranks of the run); the rollout ranks hold them unused. (None, None)
        otherwise."""
        p = self.placement
        if p.kind == "all":
            return None, None
        trainer = p.side if p.kind == "trainer" else p.peer
        layout = self.layout if p.kind == "trainer" else EngineLayout.of(
            self.cfg, self.world_size, side_ranks=trainer.ranks, side="trainer",
            device_type=self.device.type)
        if layout.mesh:
            return None, build_train_mesh(layout.side_size, layout.tp, layout.sp,
                                          self.device.type, layout.fsdp_shard_size,
                                          ranks=trainer.ranks)
        if layout.hsdp:
            return hsdp_mesh(trainer.ranks, layout.fsdp_shard_size, self.device.type), None
        return None, None

    def _choose_checkpointing(self, cfg: Config, needed: set[str], runtime_rss: int
                              ) -> Config:
        """`cfg` with actor.activation_checkpointing=auto resolved on the side's estimated peak
        without it and its least free memory, so every rank decides alike (collective).
        `runtime_rss`: what this process holds outside the estimate (before an extra policy's
        engines: the main policy's too)."""
        peak, free = peak_and_room(cfg, model_shape(cfg), self.device,
                                   self.dist.local_world_size, runtime_rss,
                                   has_ref="ref" in needed, has_critic="critic" in needed)
        peak = int(self.side.max(peak))
        least_free = -self.side.max(-(free if free is not None else 0))
        free = int(least_free) if least_free > 0 else None
        on = checkpointing_needed(peak, free)
        self.log(describe_choice(on, peak, free))
        return with_checkpointing(cfg, on)

    def _estimate_memory(self, needed: set[str], runtime_rss: int) -> float:
        """The plan's estimate, for the report beside the measured peak: the largest over the
        side's ranks (a rank without the actor reports 0), so every rank logs the same
        metrics. Sync placements only: the estimate knows no async sides yet."""
        cfg, estimate = self.cfg, 0.0
        if self.engines.actor is not None and self.placement.kind == "all":
            lines = estimate_memory(cfg, ModelShape.of(self.engines.actor.model.config),
                                    has_ref="ref" in needed, has_critic="critic" in needed)
            with_ref = {name for name in cfg.models if "ref" in engines_of(self.plan, name)}
            lines += other_model_lines(cfg, other_model_shapes(cfg), with_ref)
            estimate = estimated_peak(lines, runtime_rss) / GB
        estimate = self.side.max(estimate)
        if estimate > 0:
            self.log(f"memory: estimated peak {estimate:.2f} GiB per rank (dagrl plan --memory "
                     "for the breakdown)")
        return estimate

    def _open_streams(self) -> None:
        """The placement's batch source and sink (runtime/streams.py); in async mode the
        rollout ranks generate through a versioned engine fed by the trainer's weights, and the
        trainer ranks' weight sync sends to them."""
        p, cfg, device = self.placement, self.cfg, self.device
        staleness = cfg.rollout.max_staleness
        wire = DTYPES[cfg.model.rollout_dtype]
        last = cfg.trainer.total_steps - 1   # no batch is generated with a later version
        if p.kind == "all":
            self.source = PromptSource(self.loader, device)
            self.sink = MetricsSink(self.side, self.observer)
        elif p.kind == "rollout":
            policies = self.policy_engines()
            if p.side.size > 1 and any(getattr(e.rollout, "serves_every_rank", False)
                                       for e in policies):
                # Each async rollout rank takes a new version between its own requests.
                raise ConfigError("trainer.mode=async with rollout.backend=server needs one "
                                  "rollout rank: the servers are shared by the rollout ranks "
                                  f"({p.side.size} here), which take each new version each "
                                  "at its own time; give the rollout nodes one rank")
            self.source = FreshWeightsPromptSource(
                self.loader, device, [e.rollout for e in policies], source_rank=p.peer.lead,
                dtype=wire, last_version=last, max_staleness=staleness,
                group=self.dist.cpu_group)
            r = cfg.rollout
            for engines in policies:   # the receivers above load into the wrapped engines
                engines.rollout = VersionedRollout(
                    engines.rollout, chunk_tokens=r.partial_chunk_tokens if r.partial else 0,
                    between_chunks=self.source.between_chunks if r.partial else None)
                if engines.agent is not None:   # episodes' turns go through it too
                    engines.agent.engine = engines.rollout
            self.sink = GroupSink(p.peer.ranks, self.dist.cpu_group, self.source)
        else:
            self.source = GroupSource(p.peer.ranks, self.dist.cpu_group, device, staleness)
            self.sink = MetricsSink(self.side, self.observer)
            for i, engines in enumerate(self.policy_engines()):   # a channel per policy
                engines.weight_sink = WeightSender(p.peer.ranks, is_source=self.is_lead,
                                                   dtype=wire, last_version=last,
                                                   group=self.dist.cpu_group, tag=policy_tag(i))
