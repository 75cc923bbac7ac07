"""Weights from the trainer ranks to the rollout ranks (trainer.mode=async), in the background.

After an update the trainer ranks gather the full weights bucket by bucket (weight_sync.py, a
collective over the trainer ranks), and the first trainer rank packs them into flat buckets in
the rollout's dtype and `isend`s each bucket to every rollout rank: the call returns at once and
the transport moves the bytes while the trainer goes on (to pull its next batch) and the rollout
ranks go on generating. A rollout rank keeps `irecv`s posted into preallocated buckets for the
next version; between requests it checks whether they completed (`poll`) and, if so, copies the
weights into its engine (`RolloutEngine.update_weights`) and posts the receives for the version
after. So generation never stops for a transfer, only for the copy.

Both ends cut the same buckets from one layout, (name, shape) of every tensor in the order the
trainer yields them, which the first trainer rank sends once at start (with the first weights:
the rollout ranks then hold exactly the trainer's weights, also after a resume).

Messages, per version, trainer rank t0 -> each rollout rank: int64 [1] version, then each
bucket [numel] in the rollout's dtype. Each trained policy (the main one, then each of
`models`) has a channel of its own, told apart by its message tag (`policy_tag`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from dagrl.data.async_buffer import PendingSends, outliving_profiler
from dagrl.engines.weight_sync import BUCKET_BYTES

TAG_WEIGHTS = 1711


def policy_tag(index: int) -> int:
    """The message tag of the index-th policy's weights (0: the main policy)."""
    return TAG_WEIGHTS + index
Layout = list[tuple[str, tuple[int, ...]]]


def bucket_bounds(layout: Layout, element_size: int, limit: int = BUCKET_BYTES) -> list[int]:
    """Indices into `layout` where buckets start (and len(layout) at the end): consecutive
    tensors until the next would pass `limit` bytes."""
    bounds, size = [0], 0
    for i, (_, shape) in enumerate(layout):
        nbytes = math.prod(shape) * element_size
        if size and size + nbytes > limit:
            bounds.append(i)
            size = 0
        size += nbytes
    bounds.append(len(layout))
    return bounds


class WeightSender:
    """The trainer ranks' end: the engines' weight sink (`Engines.weight_sink`), so the
    actor_update role's `sync_rollout_weights()` sends the weights after each update.
    `last_version`: the versions after it are not sent (no batch would use them)."""

    def __init__(self, rollout_ranks: Sequence[int], *, is_source: bool, dtype: torch.dtype,
                 last_version: int, group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = BUCKET_BYTES, tag: int = TAG_WEIGHTS) -> None:
        self.rollout_ranks, self.is_source = tuple(rollout_ranks), is_source
        self.dtype, self.group, self.bucket_bytes = dtype, group, bucket_bytes
        self.tag = tag
        self.last_version = last_version
        self.weights_version = 0    # the policy version (training steps) last sent
        self._pending = PendingSends()

    def send_first(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """At start: the layout, then the weights of `version`, waited for."""
        tensors = list(named_tensors)   # every trainer rank takes part in the gather
        if self.is_source:
            layout = [(name, tuple(t.shape)) for name, t in tensors]
            for dst in self.rollout_ranks:
                dist.send_object_list([layout], dst, group=self.group)
        self._send(iter(tensors), version)
        self.flush()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Called by Engines.sync_rollout_weights after an update; `version` is the actor's
        optimizer-step count, and the policy version sent is `self.weights_version + 1` (one per
        training step). Every trainer rank calls it (the gather is collective)."""
        if self.weights_version + 1 > self.last_version:
            self.weights_version += 1    # nothing to send: no batch left to generate
            return
        self._send(iter(named_tensors), self.weights_version + 1)

    def _send(self, named: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        self.weights_version = version
        if not self.is_source:
            for _ in named:   # take part in every all-gather
                pass
            return
        keep: list[torch.Tensor] = [torch.tensor([version], dtype=torch.int64)]
        with outliving_profiler():
            works = [dist.isend(keep[0], dst, group=self.group, tag=self.tag)
                     for dst in self.rollout_ranks]
        bucket: list[torch.Tensor] = []
        size = 0
        element = torch.empty(0, dtype=self.dtype).element_size()

        def send_bucket() -> None:
            flat = torch.cat(bucket)   # [numel of the bucket], the rollout's dtype
            keep.append(flat)
            with outliving_profiler():
                works.extend(dist.isend(flat, dst, group=self.group, tag=self.tag)
                             for dst in self.rollout_ranks)

        for _, tensor in named:
            nbytes = tensor.numel() * element
            if bucket and size + nbytes > self.bucket_bytes:
                send_bucket()
                bucket, size = [], 0
            bucket.append(tensor.detach().reshape(-1).to(self.dtype, copy=True))
            size += nbytes
        if bucket:
            send_bucket()
        self._pending.add(works, keep)   # the buffers live until the sends complete

    def flush(self) -> None:
        self._pending.flush()


class WeightReceiver:
    """A rollout rank's end: receives versions in order into preallocated buckets and loads
    them into `engine` (any RolloutEngine) when asked."""

    def __init__(self, engine, source: int, *, dtype: torch.dtype, last_version: int,
                 group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = BUCKET_BYTES, tag: int = TAG_WEIGHTS) -> None:
        self.engine, self.source, self.group, self.tag = engine, source, group, tag
        self.last_version = last_version
        box: list = [None]
        dist.recv_object_list(box, source, group=self.group)
        self.layout: Layout = box[0]
        element = torch.empty(0, dtype=dtype).element_size()
        self.bounds = bucket_bounds(self.layout, element, bucket_bytes)
        self.buckets = [torch.empty(sum(math.prod(s) for _, s in self.layout[a:b]), dtype=dtype)
                        for a, b in zip(self.bounds, self.bounds[1:], strict=False)]
        self.version_box = torch.empty(1, dtype=torch.int64)
        self.version = -1           # loaded into the engine
        self._arrived: threading.Event | None = None
        self._errors: list[BaseException] = []
        self._post()

    def _post(self) -> None:
        """Post the receives of the next version; a daemon thread waits for them (gloo cannot
        be polled: see data/async_buffer.PendingSends) and raises the event when all are in."""
        with outliving_profiler():
            works = [dist.irecv(self.version_box, self.source, group=self.group,
                                tag=self.tag)]
            works += [dist.irecv(b, self.source, group=self.group, tag=self.tag)
                      for b in self.buckets]
        arrived = self._arrived = threading.Event()

        def wait() -> None:
            try:
                for w in works:
                    w.wait()
            except BaseException as err:   # noqa: BLE001 — raised in the loop's thread
                self._errors.append(err)
            arrived.set()

        threading.Thread(target=wait, daemon=True, name="dagrl-async-weights").start()

    @property
    def expecting(self) -> bool:
        """Whether another version will come (receives are posted for it)."""
        return self._arrived is not None

    def _load(self) -> None:
        if self._errors:
            raise RuntimeError(f"weights: receiving from rank {self.source} failed "
                               f"({self._errors[0]})") from self._errors[0]
        version = int(self.version_box.item())
        self.engine.update_weights(self._named(), version)
        self.version = version
        # The buckets are free again: post the receives of the next version, if one comes.
        self._arrived = None
        if version < self.last_version:
            self._post()

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, a, b in zip(self.buckets, self.bounds, self.bounds[1:], strict=False):
            offset = 0
            for name, shape in self.layout[a:b]:
                n = math.prod(shape)
                yield name, bucket[offset:offset + n].view(shape)
                offset += n

    def poll(self) -> bool:
        """Load the next version if it has fully arrived; never waits. True if loaded."""
        if self._arrived is not None and self._arrived.is_set():
            self._load()
            return True
        return False

    def poll_all(self) -> bool:
        """Load every version that has fully arrived (the newest wins). True if any loaded."""
        loaded = False
        while self.poll():
            loaded = True
        return loaded

    def wait_for(self, version: int) -> None:
        """Block until the engine holds `version` or a newer one."""
        while self.version < version:
            if self._arrived is None:
                raise RuntimeError(f"weights: waiting for version {version}, but the last one "
                                   f"to come ({self.last_version}) is loaded")
            self._arrived.wait()
            self._load()
