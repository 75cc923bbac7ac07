"""FSDP2 sharding of a HF causal LM over the data-parallel ranks (and the optional per-layer
torch.compile applied before it).

Each decoder layer is its own FSDP unit (its parameters are all-gathered just before it runs
and freed after), and the root module holds the rest (embeddings, final norm, LM head; tied
embeddings share one parameter there). Gradients are reduce-scattered and *averaged* over the
ranks, which the actor's loss scaling accounts for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from dagrl.device import pins_host_memory


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a HF model (LlamaDecoderLayer, Qwen2DecoderLayer, ...)."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


def compile_layers(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile each decoder layer in place (torchtitan's per-block compile): the layers
    share one compiled graph, FSDP2's hooks stay outside it, and the model's own forward
    (masks, embeddings, loss) stays eager."""
    for layer in decoder_layers(model):
        layer.compile()
    return model


def checkpoint_activations(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' activation checkpointing of every decoder layer, non-reentrant (before
    sharding: the recompute then runs through FSDP2's hooks like the forward did). Applies in
    training mode only; forward-only passes are untouched."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.20
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def hsdp_mesh(ranks: tuple[int, ...], shard_size: int, device_type: str) -> DeviceMesh:
    """HSDP's 2-D (replicate, shard) mesh over `ranks`, a subset of the run's (the async
    trainer side): groups of `shard_size` consecutive ranks. Collective over *every* rank of
    the run, members or not (each of its process groups is made by all of them)."""
    mesh = torch.tensor(ranks).view(len(ranks) // shard_size, shard_size)
    return DeviceMesh(device_type, mesh, mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, world_size: int, device_type: str,
                shard_size: int = 0,
                group: dist.ProcessGroup | None = None,
                offload: bool = False,
                mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """Shard `model` in place over all `world_size` ranks, or over the ranks of `group`
    (trainer.mode=async: the trainer ranks; `world_size` is then their number); a no-op for
    one rank. With 0 < `shard_size` < `world_size`, over groups of `shard_size` consecutive
    ranks and replicated across the groups (HSDP: a 2-D mesh, replicas x shard; FSDP2
    reduce-scatters gradients in a group, then all-reduces each shard across the groups); over
    a subgroup that mesh is made beforehand by every rank (`hsdp_mesh`) and passed as `mesh`.
    `offload`: the shards live in host memory (see fully_shard_layers)."""
    if world_size == 1:
        return model
    if mesh is None:
        mesh = _fsdp_mesh(world_size, device_type, shard_size, group)
    return fully_shard_layers(model, mesh, offload)


def _fsdp_mesh(world_size: int, device_type: str, shard_size: int,
               group: dist.ProcessGroup | None) -> DeviceMesh:
    if 0 < shard_size < world_size:
        if group is not None:
            raise ValueError("HSDP over a subgroup of the ranks needs its mesh made by every "
                             "rank beforehand (hsdp_mesh)")
        if world_size % shard_size:
            raise ValueError(f"trainer.fsdp_shard_size={shard_size} does not divide "
                             f"{world_size} ranks")
        return init_device_mesh(device_type, (world_size // shard_size, shard_size),
                                mesh_dim_names=("replicate", "shard"))
    if group is not None:
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def fully_shard_layers(model: torch.nn.Module, mesh: DeviceMesh,
                       offload: bool = False) -> torch.nn.Module:
    """FSDP2 over `mesh`: each decoder layer a unit, then the root (in place). A 1-D mesh
    shards over all its ranks; HSDP's 2-D (replicate, shard) mesh shards over the second
    dimension and replicates over the first. On parameters already split by tensor
    parallelism (1-D mesh only) it shards their local slices (a 2-D layout).

    `offload` (actor/ref/critic.offload): FSDP2's CPUOffloadPolicy. Parameter shards and
    their gradients stay in host memory (so does the optimizer state built on them); each
    unit's all-gather copies its shards to the mesh's device first, and the reduce-scattered
    gradients come back to the host. Collectives on these host tensors (gradient-norm
    all-reduce, weight gathers for the rollout, checkpoints) run over gloo: the process group
    then has a host backend beside the accelerator's (device.collective_backend)."""
    policy = (CPUOffloadPolicy(pin_memory=pins_host_memory(mesh.device_type)) if offload
              else OffloadPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model
