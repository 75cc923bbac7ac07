"""`actor.activation_checkpointing=auto`: recompute the decoder layers in backward only where the
update would not fit in memory without it.

Checkpointing trades memory for time: each layer's intermediates are dropped after the forward
and recomputed in backward, one more forward of the micro-batch (measured on the SmolLM2
update, 2 CPU threads: +44% time per sample in bfloat16 autocast, +27% in float32; the saved
activations shrink to one hidden state per layer). So it should be on exactly when memory
needs it. The decision reads the same estimate as `dagrl plan --memory`
(engines/memory_estimate.py) with checkpointing off, against the memory free to this rank
when the engines are about to be built (device.free_memory_bytes: the host's available memory
shared by its ranks, or the accelerator's free memory), keeping 15% for what the estimate does
not count (allocator fragmentation, the optimizer's temporaries). Every rank of a side must
decide alike (FSDP2 runs the same layers on each): the worker takes the verdict of the rank
with the least room.
"""

from __future__ import annotations

from dataclasses import replace

from dagrl.config.schema import Config
from dagrl.engines.memory_estimate import GiB, ModelShape, estimate_memory, estimated_peak

# The share of the free memory the estimated peak may fill: the estimate leaves out the
# allocator's fragmentation and short-lived temporaries.
FILL = 0.85


def with_checkpointing(cfg: Config, on: bool) -> Config:
    """`cfg` with actor.activation_checkpointing set to `on` (a new config)."""
    return replace(cfg, actor=replace(cfg.actor, activation_checkpointing=on))


def peak_without_checkpointing(cfg: Config, shape: ModelShape, runtime_bytes: int, *,
                               has_ref: bool, has_critic: bool) -> int:
    """`dagrl plan --memory`'s estimated peak per rank with the actor's layers not recomputed."""
    lines = estimate_memory(with_checkpointing(cfg, False), shape, has_ref=has_ref,
                            has_critic=has_critic)
    return estimated_peak(lines, runtime_bytes)


def room_for_rank(device, ranks_here: int) -> int | None:
    """The memory this rank's estimated peak may fill: the device's free memory, and on the
    host also what this process already holds (the estimate counts it: its runtime line)."""
    from dagrl.device import free_memory_bytes, is_host
    from dagrl.observe.memory import host_rss_bytes

    free = free_memory_bytes(device, ranks_here)
    if free is None or not is_host(device):
        return free
    return free + host_rss_bytes()


def checkpointing_needed(peak_bytes: int, free_bytes: int | None) -> bool:
    """Whether the update needs checkpointing: its peak without it over FILL of the free
    memory (or the free memory unknown)."""
    return free_bytes is None or peak_bytes > FILL * free_bytes


def describe_choice(on: bool, peak_bytes: int, free_bytes: int | None) -> str:
    """The log line that says what auto chose and why."""
    room = ("the free memory unknown" if free_bytes is None else
            f"{'over' if on else 'within'} {FILL:.0%} of the {free_bytes / GiB:.2f} GiB free "
            "to this rank")
    return (f"actor.activation_checkpointing=auto: {'on' if on else 'off'} (estimated peak "
            f"{peak_bytes / GiB:.2f} GiB per rank without it, {room})")


def peak_and_room(cfg: Config, shape: ModelShape, device, ranks_here: int, runtime_bytes: int,
                  *, has_ref: bool, has_critic: bool) -> tuple[int, int | None]:
    """(the estimated peak without checkpointing, the memory free to the rank) on `device`,
    which `ranks_here` ranks share when it is the host. On an accelerator the estimate is of
    device memory, which the host runtime (`runtime_bytes`) is not part of."""
    from dagrl.device import is_host

    host = is_host(device)
    peak = peak_without_checkpointing(cfg, shape, runtime_bytes if host else 0,
                                      has_ref=has_ref, has_critic=has_critic)
    return peak, room_for_rank(device, ranks_here if host else 1)


def choose_here(cfg: Config, shape: ModelShape, runtime_bytes: int, *, has_ref: bool,
                has_critic: bool) -> tuple[Config, str]:
    """What auto would choose for a run started on this machine now (`dagrl plan --memory`):
    the config resolved and the line saying why. The run decides again when its workers build
    their engines, on the memory free then."""
    from dagrl.device import device_type, worker_device

    device = worker_device(device_type(cfg.trainer.device))
    peak, free = peak_and_room(cfg, shape, device, cfg.trainer.n_workers, runtime_bytes,
                               has_ref=has_ref, has_critic=has_critic)
    on = checkpointing_needed(peak, free)
    return with_checkpointing(cfg, on), describe_choice(on, peak, free)
