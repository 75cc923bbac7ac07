"""What the actor's update holds at its peak: `dagrl train` in this process, the update of every
step run under a dispatch mode that counts the tensor storages it creates while they are alive.
Prints per step the peak of those bytes, where it fell (which micro-batch, forward, backward or
the optimizer step), the live tensors at that moment grouped by op, shape and phase, and the
RSS the update added (the node's sampler).

    python scripts/update_tensor_census.py examples/smollm2_gsm8k.yaml trainer.total_steps=2 ...

Storages that exist before the update (weights, gradients kept from before, optimizer state,
the batch) are not counted; views of them are not new storage. The mode runs Python on every
op: the steps are several times slower than without it.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dagrl.engines import train_engine
from dagrl.observe.memory import HostPeakSampler, host_rss_bytes

MiB, GiB = 2**20, 2**30


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages created under it and still alive; their peak and, near it, what
    was alive (grouped by the op that made it, its shape and dtype, and the phase)."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.existing = existing
        self.alive: dict[int, tuple[int, str]] = {}   # id(storage) -> (bytes, label)
        self._refs: dict[int, weakref.ref] = {}
        self.now = self.peak = self._snapshot_at = 0
        self.phase, self.peak_phase = "start", ""
        self.at_peak: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                label = f"{func.overloadpacket.__name__} {tuple(t.shape)} {t.dtype} {self.phase}"
                self._add(t.untyped_storage(), label)
        return out

    def _add(self, storage: torch.UntypedStorage, label: str) -> None:
        key = id(storage)
        if key in self.alive or storage.data_ptr() in self.existing:
            return
        size = storage.nbytes()

        def freed(_, key=key, size=size) -> None:
            self.alive.pop(key, None)
            self._refs.pop(key, None)
            self.now -= size

        self._refs[key] = weakref.ref(storage, freed)
        self.alive[key] = (size, label)
        self.now += size
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
            if self.now > self._snapshot_at + 8 * MiB:   # grouping costs: every 8 MiB of peak
                self._snapshot_at = self.now
                groups: dict[str, list[int]] = {}
                for nbytes, what in self.alive.values():
                    g = groups.setdefault(what, [0, 0])
                    g[0] += nbytes
                    g[1] += 1
                self.at_peak = sorted(((w, b, n) for w, (b, n) in groups.items()),
                                      key=lambda x: -x[1])


def storages_before(engine: train_engine.TrainEngine, batch) -> set[int]:
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    tensors += [p.grad for p in engine.model.parameters() if p.grad is not None]
    tensors += [v for state in engine.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    tensors += list(batch.tensors.values())
    return {t.untyped_storage().data_ptr() for t in tensors}


def main() -> int:
    update, step = train_engine.TrainEngine.update, train_engine.TrainEngine._optimizer_step
    cut = train_engine.micro_batches
    census: list[LiveStorages] = []

    def counted_update(self, batch, metrics) -> None:
        mode = LiveStorages(storages_before(self, batch))
        census.append(mode)
        backward = torch.Tensor.backward

        def phased_backward(t, *args, **kwargs):
            mode.phase = mode.phase.replace("forward", "backward")
            return backward(t, *args, **kwargs)

        sampler, before = HostPeakSampler(every_s=0.005), host_rss_bytes()
        sampler.start()
        torch.Tensor.backward = phased_backward
        try:
            with mode:
                update(self, batch, metrics)
        finally:
            torch.Tensor.backward = backward
        _, peak = sampler.stop()
        print(f"update {len(census)}: tensors it created, alive at its peak "
              f"{mode.peak / GiB:.3f} GiB ({mode.peak_phase}); RSS +{(peak - before) / GiB:.3f}"
              f" GiB over its start ({before / GiB:.3f})", flush=True)
        for what, nbytes, count in mode.at_peak[:20]:
            print(f"  {nbytes / MiB:8.1f} MiB  x{count:<4d} {what}", flush=True)

    def phased_step(self, reported, metrics):
        census[-1].phase = "optimizer step"
        return step(self, reported, metrics)

    def phased_micro_batches(*args, **kwargs):
        parts = cut(*args, **kwargs)
        for i, (positions, micro) in enumerate(parts):
            if census:
                census[-1].phase = (f"micro-batch {i + 1}/{len(parts)} ({len(micro)} samples) "
                                    "forward")
            yield positions, micro

    train_engine.TrainEngine.update = counted_update
    train_engine.TrainEngine._optimizer_step = phased_step
    train_engine.micro_batches = phased_micro_batches
    from dagrl.train import main as train

    return train(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
