"""The one place that knows device types: which accelerator a worker uses and which
collective backend goes with it. Nothing else in dagrl names `cuda` or `npu`."""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def device_type(preference: str = "auto") -> str:
    """'cpu' | 'cuda' | 'npu': the configured type, or the best one present for 'auto'."""
    if preference == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if npu_available() else "cpu"
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device")
    if preference == "npu" and not npu_available():
        raise RuntimeError("trainer.device=npu but torch_npu is not installed or sees no NPU")
    return preference


def worker_device(kind: str, local_rank: int = 0) -> torch.device:
    """The device of a worker: one accelerator per worker process, or the CPU."""
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    index = local_rank % module.device_count()
    module.set_device(index)
    return torch.device(kind, index)


def collective_backend(kind: str) -> str:
    return BACKENDS[kind]


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name (e.g. 'NVIDIA H100 80GB HBM3'); 'cpu' on the CPU."""
    if device.type == "cpu":
        return "cpu"
    return str(getattr(torch, device.type).get_device_name(device))


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for `peak_memory_bytes` (no-op on the CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Most device memory allocated by tensors since the last reset; None on the CPU."""
    if device.type == "cpu":
        return None
    return int(getattr(torch, device.type).max_memory_allocated(device))


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
