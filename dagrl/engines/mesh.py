"""The training device mesh (data parallel x sequence parallel x tensor parallel) and what it
does to a model.

    world = dp * sp * tp          rank = (d * sp + s) * tp + t

`actor.tensor_parallel_size` (tp) and `actor.sequence_parallel_size` (sp) come from the config;
the rest of the workers are data-parallel replicas (dp). The actor, the reference and the
critic share this mesh (one training layout, so the samples move into it once per step). The
tp * sp consecutive ranks of one replica hold the same samples (the planner's replicate task,
dag/planner.py); the dp replicas hold different ones.

Which group does what:
  fsdp  (dp x sp, flattened)  FSDP2 shards every parameter (its tp slice) over it and averages
                              the gradients; under HSDP (trainer.fsdp_shard_size = k < dp x sp)
                              a 2-D (replicate, shard) mesh: groups of k consecutive dp x sp
                              ranks shard, the dp x sp / k groups replicate
  tp    (the last dim)        tensor parallelism: heads, MLP columns, vocabulary
                              (tensor_parallel.py)
  sp    (the middle dim)      Ulysses: sequence shards <-> head shards around attention
                              (ulysses.py)
  dp    (the first dim)       one rank per replica with the same (s, t): sums over it (loss
                              denominators) count each sample once
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dagrl.engines.sharding import fully_shard_layers
from dagrl.engines.tensor_parallel import tensor_parallelize
from dagrl.engines.ulysses import ulysses_parallelize


@dataclass
class TrainMesh:
    dp: int = 1
    sp: int = 1
    tp: int = 1
    mesh: DeviceMesh | None = None        # None: one worker, nothing is sharded
    # The dims FSDP2 shards over: ("dp",), ("fsdp",) (dp x sp flattened) or, HSDP, the 2-D
    # ("replicate", "shard"), shard = k of the dp x sp ranks. Sliced when used: a rank outside
    # the mesh (an async rollout rank, which helped make its groups) cannot slice it.
    fsdp_dims: tuple[str, ...] = ("dp",)

    @property
    def world(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 averages gradients over."""
        return self.dp * self.sp

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        return self.mesh[self.fsdp_dims] if self.mesh is not None else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.mesh is not None and self.tp > 1 else None

    @property
    def sp_mesh(self) -> DeviceMesh | None:
        return self.mesh["sp"] if self.mesh is not None and self.sp > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The replicas' group (the ranks with this rank's s and t); None with one replica."""
        if self.mesh is None or self.dp == 1:
            return None
        return self.mesh["dp"].get_group()


def build_train_mesh(world_size: int, tensor_parallel: int, sequence_parallel: int,
                     device_type: str, shard_size: int = 0,
                     ranks: tuple[int, ...] | None = None) -> TrainMesh:
    """The (dp, sp, tp) mesh for `world_size` ranks (collective: every rank calls it).
    `shard_size` = k with 0 < k < dp x sp: HSDP over the fsdp ranks, k a multiple of sp (the
    dp ranks split into dp x sp / k replicate groups of k / sp). `ranks`: the mesh's ranks
    when not all of the run's (an async trainer side, `world_size` of them); every rank of the
    run still calls this, since each of the mesh's process groups is made by all of them."""
    tp, sp = tensor_parallel, sequence_parallel
    if world_size % (tp * sp):
        raise ValueError(f"{world_size} workers do not split into tensor-parallel groups of {tp} "
                         f"x sequence-parallel groups of {sp}")
    if world_size == 1:
        return TrainMesh()
    dp = world_size // (tp * sp)
    if 0 < shard_size < dp * sp:
        return _hsdp_mesh(dp, sp, tp, device_type, shard_size, ranks)
    mesh = _device_mesh(device_type, (dp, sp, tp), ("dp", "sp", "tp"), ranks)
    if sp == 1:
        return TrainMesh(dp, sp, tp, mesh, ("dp",))
    mesh["dp", "sp"]._flatten("fsdp")
    return TrainMesh(dp, sp, tp, mesh, ("fsdp",))


def _device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
                 ranks: tuple[int, ...] | None) -> DeviceMesh:
    """The mesh over all ranks, or over `ranks` (a subset). A rank outside a mesh can make its
    process groups but cannot slice it, and flattening dims (FSDP2's dp x sp, HSDP's shard)
    slices first: so where the other ranks fill whole copies of the layout, every rank gets a
    copy (a leading "side" dim: `ranks` first, then the rest in order), slices and flattens
    alike, and only `ranks` use theirs."""
    if ranks is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    world = dist.get_world_size()
    if world % len(ranks):
        return DeviceMesh(device_type, torch.tensor(ranks).view(shape), mesh_dim_names=names)
    order = [*ranks, *(r for r in range(world) if r not in ranks)]
    return DeviceMesh(device_type, torch.tensor(order).view(world // len(ranks), *shape),
                      mesh_dim_names=("side", *names))


def _hsdp_mesh(dp: int, sp: int, tp: int, device_type: str, shard_size: int,
               ranks: tuple[int, ...] | None) -> TrainMesh:
    """HSDP on the training mesh: dp = replicate x dp_shard, each FSDP2 group the
    dp_shard x sp ranks of one replica (flattened, as torchtitan does with context
    parallelism); `dp` (one rank per data-parallel replica) is replicate x dp_shard again."""
    if shard_size % sp or dp * sp % shard_size:
        raise ValueError(f"trainer.fsdp_shard_size ({shard_size}) must be a multiple of "
                         f"actor.sequence_parallel_size ({sp}) that divides the {dp * sp} "
                         "ranks FSDP2 shards over")
    dp_shard = shard_size // sp
    names = ("replicate", "dp_shard", "sp", "tp")
    mesh = _device_mesh(device_type, (dp // dp_shard, dp_shard, sp, tp), names, ranks)
    mesh["dp_shard", "sp"]._flatten("shard")
    mesh["replicate", "dp_shard"]._flatten("dp")
    return TrainMesh(dp, sp, tp, mesh, ("replicate", "shard"))


def parallelize_model(model: torch.nn.Module, mesh: TrainMesh,
                      offload: bool = False) -> torch.nn.Module:
    """Tensor parallelism, then Ulysses attention, then FSDP2 over the fsdp mesh (in place; a
    no-op for one worker). `offload`: FSDP2 keeps the shards (of each tp slice) in host
    memory."""
    if mesh.mesh is None:
        return model
    if mesh.tp > 1:
        tensor_parallelize(model, mesh.tp_mesh)
    if mesh.sp > 1:
        ulysses_parallelize(model, mesh.sp_mesh, mesh.tp)
    return fully_shard_layers(model, mesh.fsdp_mesh, offload)
