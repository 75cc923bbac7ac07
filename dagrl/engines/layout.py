"""One engine layout: every decision about where a worker's models live and how they are held,
computed once from the config and the ranks, and read by both the engine build (bundle.py) and
`dagrl plan --memory` (memory_estimate.py), so the two cannot disagree.

    side          all (sync) | trainer | rollout (trainer.mode=async: one layout per side)
    side_ranks    the ranks the models built here shard over: all of them, or the side's
    mesh          (dp, sp, tp) of the training mesh (tensor / sequence parallelism) over the
                  ranks that train (sync: all; async: the trainer side's), or None
    fsdp_shard_size   ranks one FSDP2 group shards a model over: all the side's ranks, or
                  trainer.fsdp_shard_size (HSDP: the groups replicate; on the mesh, groups of
                  the dp x sp ranks that shard each tp slice)
    lora_rank     LoRA adapters on the actor (the reference is then the actor, adapters off)
    offload       the models whose FSDP2 shards live in host memory
    dtypes        parameters (model.dtype), the rollout copy (model.rollout_dtype), autocast
                  compute (model.mixed_precision)
    rollout_copy  what the rollout engine's weights are: shared (the native decoder reads the
                  actor's own), merged (LoRA: the merged adapted linears, the rest shared),
                  cast (a rollout_dtype cast of the whole actor), whole (a copy per worker),
                  external (held by an engine outside the process's tensors: vLLM, servers)
    mini_batch_samples, grad_scale   the update's samples per optimizer step on a rank, and
                  the factor the loss is scaled by (the ranks FSDP2 averages gradients over)

Each decision is checked where it is made; an error names the config key. The process groups
do not exist when a layout is computed (`dagrl plan` has none): `build_engines` binds the
data-parallel group once it has made the mesh (`with_dp_group`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dagrl.config.loader import ConfigError
from dagrl.config.model_source import model_reads_images
from dagrl.config.schema import Config
from dagrl.dag.async_placement import default_trainer_ranks
from dagrl.device import device_type as resolve_device_type
from dagrl.rollout import rollout_backend

SIDES = ("all", "trainer", "rollout")
ROLLOUT_COPIES = ("shared", "merged", "cast", "whole", "external")
OFFLOADABLE = ("actor", "ref", "critic")


def rollout_owns_memory(cfg: Config) -> bool:
    """Whether the rollout backend holds the policy's weights outside this process's tensors
    (vLLM's engine, remote servers): the estimate does not count them."""
    return rollout_backend(cfg).owns_memory


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _pack_sequences(cfg: Config) -> bool:
    # A packed row restarts positions per sequence; an image-text model's tokens need M-RoPE's
    # three rows restarted too (4-row position ids), which data/vision.py does not build yet.
    _check(not (cfg.model.pack_sequences and model_reads_images(cfg.model.path)),
           f"model.pack_sequences=true: {cfg.model.path} is an image-text model, whose M-RoPE "
           "positions are computed over padded rows only; set model.pack_sequences=false")
    return cfg.model.pack_sequences


def _share_prompts(cfg: Config, mesh: tuple[int, int, int] | None) -> bool:
    # A shared-prompt row holds one prompt and several responses (engines/shared_prompts.py):
    # a sequence shard cuts one sequence into contiguous spans, and M-RoPE's positions are
    # built over padded rows.
    if not cfg.model.share_prompts:
        return False
    _check(not model_reads_images(cfg.model.path),
           f"model.share_prompts=true: {cfg.model.path} is an image-text model, whose M-RoPE "
           "positions are computed over padded rows only; set model.share_prompts=false")
    _check(mesh is None or mesh[1] == 1,
           "model.share_prompts=true with sequence parallelism: a sequence shard holds "
           "contiguous spans of one sequence, a shared-prompt row several sequences; set "
           "model.share_prompts=false or actor.sequence_parallel_size=1")
    return True


@dataclass(frozen=True)
class EngineLayout:
    device_type: str
    world_size: int                      # ranks of the run
    side: str                            # all | trainer | rollout
    side_ranks: tuple[int, ...]          # the ranks the models built here shard over
    mesh: tuple[int, int, int] | None    # (dp, sp, tp); None: FSDP2 / HSDP alone
    fsdp_shard_size: int                 # HSDP's k, else all the side's ranks
    lora_rank: int
    offload: frozenset[str]              # of actor, ref, critic
    param_dtype: str
    rollout_dtype: str
    mixed_precision: str                 # autocast compute dtype, "none" without
    rollout_copy: str                    # one of ROLLOUT_COPIES
    mini_batch_samples: int              # samples per optimizer step on a rank
    grad_scale: int                      # the loss factor: ranks FSDP2 averages gradients over
    pack_sequences: bool
    share_prompts: bool
    # One rank per data-parallel replica (loss denominators are summed over it); bound by
    # build_engines once the groups exist (None before, and with one replica).
    dp_group: object = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, cfg: Config, world_size: int, *, side_ranks: tuple[int, ...] | None = None,
           side: str | None = None, device_type: str | None = None) -> EngineLayout:
        """The layout of `world_size` ranks running `cfg`. trainer.mode=async: `side_ranks` are
        this side's ranks (default: the trainer side of the default placement) and `side` says
        which side they are (default: trainer). `device_type`: the workers' (default: the
        config's trainer.device, or this machine's best for auto)."""
        _check(world_size > 0, f"trainer.n_workers must be > 0 (got {world_size})")
        side, ranks = _side(cfg, world_size, side_ranks, side)
        mesh = _mesh(cfg, side, len(ranks))
        fsdp = _fsdp_shard_size(cfg, side, len(ranks), mesh)
        _check_mesh_copies(side, world_size, len(ranks), mesh, fsdp)
        dp = mesh[0] if mesh else len(ranks)     # data-parallel ranks (replicas under tp/sp)
        return cls(
            device_type=device_type or _device_type(cfg), world_size=world_size, side=side,
            side_ranks=ranks, mesh=mesh, fsdp_shard_size=fsdp, lora_rank=cfg.actor.lora.rank,
            offload=_offload(cfg, side, len(ranks)),
            param_dtype=cfg.model.dtype, rollout_dtype=cfg.model.rollout_dtype,
            mixed_precision=cfg.model.mixed_precision,
            rollout_copy=_rollout_copy(cfg, side, len(ranks)),
            mini_batch_samples=_mini_batch_samples(cfg, side, dp),
            grad_scale=mesh[0] * mesh[1] if mesh else len(ranks),
            pack_sequences=_pack_sequences(cfg), share_prompts=_share_prompts(cfg, mesh))

    def with_dp_group(self, group) -> EngineLayout:
        """This layout bound to the process's data-parallel group (see `dp_group`)."""
        return dataclasses.replace(self, dp_group=group)

    @property
    def side_size(self) -> int:
        return len(self.side_ranks)

    @property
    def tp(self) -> int:
        return self.mesh[2] if self.mesh else 1

    @property
    def sp(self) -> int:
        return self.mesh[1] if self.mesh else 1

    @property
    def fsdp_ranks(self) -> int:
        """Ranks FSDP2 averages gradients over: dp x sp on the mesh, else the side's."""
        return self.mesh[0] * self.mesh[1] if self.mesh else self.side_size

    @property
    def model_shard_size(self) -> int:
        """Ranks FSDP2 shards the actor, reference and critic over (each tp slice, under
        tensor parallelism): HSDP's groups, else all the fsdp ranks."""
        return min(self.fsdp_shard_size, self.fsdp_ranks)

    @property
    def replicas(self) -> int:
        """HSDP: the FSDP2 groups, each holding a whole copy (1: plain FSDP2)."""
        return self.fsdp_ranks // self.model_shard_size

    @property
    def hsdp(self) -> bool:
        return self.replicas > 1

    @property
    def ref_is_actor(self) -> bool:
        """Under LoRA the reference is the actor with its adapters off (no model of its own),
        where the actor is; an async rollout side loads the base model for it."""
        return self.lora_rank > 0 and self.side != "rollout"

    @property
    def whole_actor(self) -> bool:
        """The actor is unsharded here (one rank trains): a rollout copy is built from it."""
        return self.side_size == 1

    @property
    def ref_dtype(self) -> str:
        """The reference's linears: the autocast dtype under mixed precision (the rest keeps
        param_dtype, engines/precision.py)."""
        return self.param_dtype if self.mixed_precision == "none" else self.mixed_precision


def _device_type(cfg: Config) -> str:
    # trainer.device names the run's device, present on this machine or not; auto: this one's
    d = cfg.trainer.device
    return d if d != "auto" else resolve_device_type("auto")


def _side(cfg: Config, world_size: int, ranks: tuple[int, ...] | None,
          side: str | None) -> tuple[str, tuple[int, ...]]:
    if not cfg.is_async:
        _check(ranks is None or tuple(ranks) == tuple(range(world_size)),
               f"trainer.mode=sync shards over all {world_size} ranks, not {ranks}")
        return "all", tuple(range(world_size))
    side = side or "trainer"
    _check(side in SIDES[1:], f"trainer.mode=async: side must be trainer or rollout ({side!r})")
    ranks = tuple(ranks) if ranks is not None else default_trainer_ranks(world_size)
    _check(bool(ranks) and all(0 <= r < world_size for r in ranks),
           f"trainer.mode=async: the {side} side's ranks {ranks} must be ranks of the "
           f"{world_size} workers")
    return side, ranks


def _mesh(cfg: Config, side: str, ranks: int) -> tuple[int, int, int] | None:
    """The training mesh (dp, sp, tp) over the ranks that train. An async rollout side trains
    nothing: its reference runs forward passes sharded over its ranks, no mesh (the planner
    gives its nodes the sharded layout)."""
    a = cfg.actor
    tp, sp = a.tensor_parallel_size, a.sequence_parallel_size
    if tp * sp == 1 or side == "rollout" or (ranks == 1 and side == "all"):
        return None
    where = (f"the async trainer side's {ranks} rank(s) (of trainer.n_workers="
             f"{cfg.trainer.n_workers}; it needs >= {2 * tp * sp} workers)"
             if side == "trainer" else f"the {ranks} ranks that shard the models")
    _check(ranks % (tp * sp) == 0,
           f"actor.tensor_parallel_size ({tp}) x actor.sequence_parallel_size ({sp}) must "
           f"divide {where}")
    return ranks // (tp * sp), sp, tp


def _fsdp_shard_size(cfg: Config, side: str, ranks: int, mesh) -> int:
    """HSDP's shard group: trainer.fsdp_shard_size where it is below the ranks that shard (sync,
    and an async trainer side); an async rollout side shards its forward-only models (the
    reference) over all its ranks."""
    k = cfg.trainer.fsdp_shard_size
    workers = cfg.trainer.n_workers
    # Asked for HSDP (groups below the run's workers), an async trainer side of k ranks or fewer
    # would hold one group: plain FSDP2, not what was asked.
    _check(side != "trainer" or not 0 < k < workers or k < ranks,
           f"trainer.fsdp_shard_size ({k}): the async trainer side's {ranks} ranks (of "
           f"{workers}) make no more than one shard group, so nothing replicates; HSDP needs "
           f"more trainer ranks (trainer.n_workers >= {4 * k}) or trainer.fsdp_shard_size=0")
    if not 0 < k < ranks or side == "rollout":
        return ranks
    if mesh is None:
        _check(ranks % k == 0, f"trainer.fsdp_shard_size ({k}) must divide the {ranks} ranks")
        return k
    # On the mesh FSDP2 shards each tp slice over the dp x sp ranks: HSDP groups k of them,
    # whole sp groups (the mesh's replicate x dp_shard x sp x tp, engines/mesh.py).
    dp, sp, tp = mesh
    _check(k < dp * sp, f"trainer.fsdp_shard_size ({k}): under tensor parallelism "
                        f"({tp}) FSDP2 shards each slice over the {dp * sp} dp x sp ranks, so "
                        f"HSDP needs a shard size below {dp * sp}; set it to 0 (plain FSDP2) "
                        "or use more workers")
    _check(k % sp == 0 and dp * sp % k == 0,
           f"trainer.fsdp_shard_size ({k}) must be a multiple of actor.sequence_parallel_size "
           f"({sp}) that divides the {dp * sp} dp x sp ranks")
    return k


def _check_mesh_copies(side: str, world: int, ranks: int, mesh, fsdp: int) -> None:
    """An async trainer side's mesh whose dims must be flattened (dp x sp under tensor
    parallelism; HSDP's shard dim) is made by every rank as copies of one layout
    (mesh._device_mesh): PyTorch's DeviceMesh cannot flatten dims on a rank outside the mesh."""
    if side != "trainer" or mesh is None or world % ranks == 0:
        return
    dp, sp, tp = mesh
    _check(not (sp > 1 and tp > 1) and fsdp >= dp * sp,
           f"the async trainer side's {ranks} ranks flatten mesh dims (sequence x tensor "
           f"parallelism, or HSDP under them), which every rank of the run must do on a copy of "
           f"the mesh: the other {world - ranks} ranks must be a multiple of {ranks} (PyTorch's "
           "DeviceMesh cannot flatten dims on a rank outside the mesh); place the sides evenly")


def _offload(cfg: Config, side: str, ranks: int) -> frozenset[str]:
    """The models whose shards live in host memory. FSDP2 does it, so each needs its model
    sharded (2+ ranks; under tp/sp, FSDP2's shards of each tp slice). An async side checks the
    models it builds: the trainer side trains, the rollout side runs the reference."""
    on = {"actor": cfg.actor.offload, "ref": cfg.ref.offload, "critic": cfg.critic.offload}
    for name, flag in on.items():
        here = side == "all" or (side == "rollout") == (name == "ref")
        _check(not (flag and here) or ranks > 1,
               f"{name}.offload=true offloads FSDP2 shards, and the {side} side's models are "
               f"not sharded (1 rank); set {name}.offload=false")
    return frozenset(name for name in OFFLOADABLE if on[name])


def _rollout_copy(cfg: Config, side: str, ranks: int) -> str:
    """One worker (sync) builds the rollout copy from its whole actor: the native decoder reads
    the actor itself, LoRA merges the adapted linears only, mixed precision casts; otherwise
    (several workers, or an async rollout side without the actor) a whole copy is loaded."""
    if rollout_owns_memory(cfg):
        return "external"
    if side != "all" or ranks > 1:
        return "whole"
    m = cfg.model
    if m.rollout_dtype != m.dtype:
        return "cast"
    if cfg.actor.lora.rank:
        return "merged"
    return "shared" if rollout_backend(cfg).shares_actor_weights else "whole"


def _mini_batch_samples(cfg: Config, side: str, dp: int) -> int:
    """Samples per optimizer step on a rank: actor.mini_batch_size prompts x rollout.n over the
    data-parallel ranks (per tensor/sequence-parallel replica; async: the trainer ranks)."""
    a = cfg.actor
    _check(side == "rollout" or a.mini_batch_size % dp == 0,
           f"actor.mini_batch_size ({a.mini_batch_size}) must be divisible by the {dp} "
           f"data-parallel ranks that train")
    return a.mini_batch_size * cfg.rollout.n // dp
