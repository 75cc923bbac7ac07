"""The one module that knows device types: CPU, CUDA GPUs and Ascend NPUs.

Everything else in dagrl asks this module: which accelerator a worker uses, the collective
backend that goes with it, its RNG state, its memory statistics, its profiler activities
and the Ray resources a worker reserves.
Adding a device type means changing this file only (`tests/test_layers.py` checks that no other
library file names one).
"""

from __future__ import annotations

import importlib.util
import random
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

# torch (and numpy) are imported inside the functions that use them: the config schema reads
# DeviceChoice from here, and `dagrl train` checks a config in a second, before torch loads.

# trainer.device: a device type, or "auto" for the best one present.
DeviceChoice = Literal["auto", "cpu", "cuda", "npu"]

HOST = "cpu"
# Metrics and small Python objects always travel over gloo on the host, whatever the device.
HOST_BACKEND = "gloo"
BACKENDS = {HOST: HOST_BACKEND, "cuda": "nccl", "npu": "hccl"}
# The Ray resource a node registers for each accelerator (Ascend nodes register "NPU").
RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}
# The variable that lists the accelerators a process may use (Ray sets it for each actor).
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def device_type(preference: str = "auto") -> str:
    """'cpu' | 'cuda' | 'npu': the configured type, or the best one present for 'auto'."""
    import torch

    if preference == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if npu_available() else HOST
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device")
    if preference == "npu" and not npu_available():
        raise RuntimeError("trainer.device=npu but torch_npu is not installed or sees no NPU")
    return preference


def host_device() -> torch.device:
    import torch

    return torch.device(HOST)


def is_host(device: torch.device | str | torch.Tensor) -> bool:
    """Whether `device` (or a tensor's device) is host memory."""
    import torch

    if isinstance(device, torch.Tensor):
        return device.is_cpu
    return torch.device(device).type == HOST


def worker_device(kind: str, local_rank: int = 0) -> torch.device:
    """The device of a worker: one accelerator per worker process, or the host."""
    import torch

    if kind == HOST:
        return host_device()
    module = getattr(torch, kind)
    index = local_rank % module.device_count()
    module.set_device(index)
    return torch.device(kind, index)


def collective_backend(kind: str, host_tensors: bool = False) -> str:
    """The process group's backend for workers on `kind`. `host_tensors`: collectives will also
    see host tensors on an accelerator worker (FSDP2 CPU offload), so the group gets gloo for
    them beside the accelerator's backend ("cpu:gloo,cuda:nccl", torch picks by tensor)."""
    if host_tensors and kind != HOST:
        return f"{HOST}:{HOST_BACKEND},{kind}:{BACKENDS[kind]}"
    return BACKENDS[kind]


def pins_host_memory(kind: str) -> bool:
    """Whether host buffers copied to `kind` devices are worth pinning (page-locked memory
    makes CUDA copies asynchronous; there is nothing to pin for on the host)."""
    return kind == "cuda"


def fused_optimizer_supported(device: torch.device) -> bool:
    """AdamW's fused kernel (one pass over all parameters) exists on the host and on CUDA."""
    return device.type in (HOST, "cuda")


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name (e.g. 'NVIDIA H100 80GB HBM3'); 'cpu' on the host."""
    import torch

    if is_host(device):
        return HOST
    return str(getattr(torch, device.type).get_device_name(device))


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for `peak_memory_bytes` (no-op on the host)."""
    import torch

    if not is_host(device):
        getattr(torch, device.type).reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Most device memory allocated by tensors since the last reset; None on the host."""
    import torch

    if is_host(device):
        return None
    return int(getattr(torch, device.type).max_memory_allocated(device))


def free_memory_bytes(device: torch.device, ranks_here: int = 1) -> int | None:
    """Memory this rank may still fill: on the host, what the kernel reports available
    (MemAvailable) shared by the host's `ranks_here` ranks; on an accelerator, the driver's
    free memory of the device. None where it cannot be read."""
    import torch

    if not is_host(device):
        free, _ = getattr(torch, device.type).mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib * 1024 // max(ranks_here, 1)


def profiler_for(kind: str):
    """(profile, activities) for this device type: torch.profiler recording CPU (and CUDA)
    activity, or torch_npu's profiler with the NPU activity on Ascend."""
    if kind == "npu":
        import torch_npu

        prof = torch_npu.profiler
        return prof.profile, [prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU]
    from torch import profiler as prof

    activities = [prof.ProfilerActivity.CPU]
    if kind == "cuda":
        activities.append(prof.ProfilerActivity.CUDA)
    return prof.profile, activities


def _accelerators() -> list[str]:
    """Accelerator types whose RNG this process has started (their state is worth saving)."""
    import torch

    found = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found.append("cuda")
    if npu_available() and torch.npu.is_initialized():
        found.append("npu")
    return found


def rng_state() -> dict:
    """Every RNG this process draws from: torch (host and accelerators), numpy, python."""
    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    for kind in _accelerators():
        state[kind] = getattr(torch, kind).get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    for kind in RAY_RESOURCE:   # the accelerator types
        if kind in state and (torch.cuda.is_available() if kind == "cuda" else npu_available()):
            getattr(torch, kind).set_rng_state(state[kind])


def ray_resource(kind: str) -> str | None:
    """The Ray resource a worker of this device type reserves ("GPU", "NPU"); None on the host."""
    return RAY_RESOURCE.get(kind)


def visible_devices_env(kind: str) -> str | None:
    """The variable through which Ray hands a worker its accelerators (None on the host)."""
    return VISIBLE_DEVICES_ENV.get(kind)


def ray_device_type(preference: str, cluster_resources: dict[str, float]) -> str:
    """The device type of a Ray run, decided by the driver. A configured type is taken as is
    (each worker checks it has one); "auto" is the accelerator the *cluster* offers, not the
    driver's own: a driver on a CPU-only head node still runs its workers on the GPU nodes."""
    if preference != "auto":
        return preference
    for kind, resource in RAY_RESOURCE.items():   # CUDA first, as in device_type
        if cluster_resources.get(resource, 0) > 0:
            return kind
    return HOST


def ray_bundle(kind: str) -> dict[str, float]:
    """The Ray placement-group bundle of one worker: a CPU, plus its accelerator."""
    bundle = {"CPU": 1.0}
    if kind in RAY_RESOURCE:
        bundle[RAY_RESOURCE[kind]] = 1.0
    return bundle


def ray_actor_options(kind: str) -> dict:
    """Resource options of one worker actor. Ray assigns the accelerator and names it in the
    actor's visible-devices variable: `num_gpus` for CUDA, the "NPU" resource for Ascend (Ray's
    NPU accelerator manager sets ASCEND_RT_VISIBLE_DEVICES)."""
    if kind == "cuda":
        return {"num_cpus": 1, "num_gpus": 1}
    if kind in RAY_RESOURCE:
        return {"num_cpus": 1, "resources": {RAY_RESOURCE[kind]: 1}}
    return {"num_cpus": 1}


def ray_worker_envs(kind: str, placements: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """The device environment of each Ray worker, from where Ray placed it: `placements[rank]`
    is (node id, the accelerator ids Ray assigned to that rank).

    As under torchrun, LOCAL_RANK is the worker's index among the run's workers on its node (in
    rank order) and LOCAL_WORLD_SIZE their number. Ray shows each actor only its own
    accelerator; the workers of a node are shown all of the node's accelerators of this run
    instead, in local-rank order, so device index LOCAL_RANK is the worker's own accelerator
    (what `worker_device` and vLLM's external launcher pick) and peers on the node are visible
    to the collective library (NCCL/HCCL use NVLink/HCCS between visible devices).
    """
    var = visible_devices_env(kind)
    by_node: dict[str, list[int]] = {}
    for rank, (node, _) in enumerate(placements):
        by_node.setdefault(node, []).append(rank)
    envs = []
    for rank, (node, ids) in enumerate(placements):
        local = by_node[node]
        env = {"LOCAL_RANK": str(local.index(rank)), "LOCAL_WORLD_SIZE": str(len(local))}
        if var is not None:
            if len(ids) != 1:
                raise RuntimeError(f"rank {rank}: Ray assigned {len(ids)} {RAY_RESOURCE[kind]} "
                                   f"devices ({ids}); a worker needs exactly one")
            env[var] = ",".join(placements[r][1][0] for r in local)
        envs.append(env)
    return envs


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether bfloat16 matmuls run natively (faster than float32) on `device`: always on CUDA
    and NPU; on the host only with AVX512-BF16 or AMX (oneDNN), elsewhere they are emulated and
    slower than float32."""
    import torch

    if device.type != HOST:
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
