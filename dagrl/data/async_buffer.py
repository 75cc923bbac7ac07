"""The async buffer (trainer.mode=async): rollout ranks push finished, scored groups to the
trainer ranks point to point; no collective, no coordinator, no rank that holds the global batch.

Each rollout rank splits the batch it produced (its share of one step's prompts, all their
samples) into one part per trainer rank — whole groups, by `balanced_partition` of their
tokens — and sends each part with `isend`: a header, then one payload. The send returns at once
(the transport moves the bytes in the background) and the rollout rank goes on generating; it
keeps the buffers until the sends complete. A trainer rank pulls batch k by receiving, from each
rollout rank in rank order, its part of batch k (blocking: the time it waits is the trainer's
wait). Batches arrive in the order they were pushed, so the trainer takes them in data order.

Message layout, per (rollout rank, trainer rank, batch):
    header   int64 [4]: meta bytes, batch bytes, batch index, 0
    payload  uint8 [meta bytes + batch bytes]: pickled metadata (padded to 8 bytes), then the
             batch's chunk (`buffer.pack`: schema, non-tensor fields, each tensor's bytes)
The metadata (the rollout side's metrics, the dataloader position) goes to the first trainer
rank only, so it is counted once when the trainer ranks reduce their metrics.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dagrl.data.batch import Batch
from dagrl.data.buffer import balanced_partition, group_runs, pack, sample_tokens, unpack
from dagrl.device import HOST

# Tags keep this traffic apart from the weights flowing the other way between the same ranks.
TAG_HEADER = 1701
TAG_PAYLOAD = 1702


@contextlib.contextmanager
def outliving_profiler() -> Iterator[None]:
    """Post point-to-point work that outlives the call with torch's record functions off.

    Such work closes its record function when it completes, in the thread that waits for it,
    possibly after a torch.profiler session that was on when it was posted has stopped and
    freed its state: the profiler's callback then writes into freed memory (a SIGSEGV at
    profiler stop, or bad_alloc in export, on async ranks with profiler.enable=true). Two
    gloo processes posting an irecv and an isend in each of 200 sessions, completed after the
    session: 3 crashes in 4 runs; 0 in 4 with this. The traces lose these transfers' spans
    (the send is in flight in the background, not on the task's time), nothing else."""
    torch._C._autograd._enable_record_function(False)
    try:
        yield
    finally:
        torch._C._autograd._enable_record_function(True)


class PendingSends:
    """Sends in flight. gloo's `Work.is_completed()` stays False until `wait()` has been called,
    and a `wait(timeout)` that expires breaks every pending operation of the group, so the only
    way to learn that a send is done is to wait for it: each batch of sends gets a daemon thread
    that waits (releasing the GIL) while holding the buffers, and drops them when done."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def add(self, works: list[dist.Work], buffers: list[torch.Tensor]) -> None:
        self.check()

        def wait(keep: list[torch.Tensor] = buffers) -> None:   # `keep`: alive until sent
            try:
                for w in works:
                    w.wait()
            except BaseException as err:   # noqa: BLE001 — raised in the caller's thread
                self._errors.append(err)

        thread = threading.Thread(target=wait, daemon=True, name="dagrl-async-send")
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def check(self) -> None:
        if self._errors:
            raise RuntimeError(f"async: a send failed ({self._errors[0]})") from self._errors[0]

    def flush(self) -> None:
        """Wait until every send has completed."""
        for t in self._threads:
            t.join()
        self._threads = []
        self.check()

    def __len__(self) -> int:
        self._threads = [t for t in self._threads if t.is_alive()]
        return len(self._threads)


def split_for_trainers(batch: Batch, parts: int) -> list[Batch]:
    """Whole groups over `parts` trainer ranks, equal group counts (±1), similar tokens."""
    starts = group_runs(batch)
    if parts == 1 or not len(starts):
        return [batch] + [batch.select([]) for _ in range(parts - 1)]
    tokens = sample_tokens(batch).numpy()
    weights = [int(x) for x in np.add.reduceat(tokens, starts)]
    owner = balanced_partition(weights, parts)
    sizes = np.diff(np.append(starts, len(batch)))
    sample_owner = np.repeat(np.asarray(owner), sizes)
    # Groups keep their order within a part, so a part is contiguous runs of whole groups.
    return [batch.select(np.flatnonzero(sample_owner == p).tolist()) for p in range(parts)]


class GroupSender:
    """A rollout rank's end of the buffer."""

    def __init__(self, trainer_ranks: Sequence[int], group: dist.ProcessGroup | None = None):
        self.trainer_ranks = tuple(trainer_ranks)
        self.group = group
        self._pending = PendingSends()

    def push(self, batch: Batch, index: int, meta: dict) -> None:
        """Send batch `index` (this rank's share) to the trainer ranks; returns without waiting."""
        for i, (dst, part) in enumerate(zip(self.trainer_ranks,
                                            split_for_trainers(batch, len(self.trainer_ranks)),
                                            strict=True)):
            meta_bytes = pickle.dumps(meta if i == 0 else {}, protocol=pickle.HIGHEST_PROTOCOL)
            meta_bytes += bytes(-len(meta_bytes) % 8)   # the chunk after it stays 8-aligned
            chunk = pack(part)
            header = torch.tensor([len(meta_bytes), chunk.numel(), index, 0], dtype=torch.int64)
            payload = torch.cat([torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8),
                                 chunk])
            with outliving_profiler():
                works = [dist.isend(header, dst, group=self.group, tag=TAG_HEADER),
                         dist.isend(payload, dst, group=self.group, tag=TAG_PAYLOAD)]
            self._pending.add(works, [header, payload])

    def flush(self) -> None:
        """Wait until every pushed batch has been received."""
        self._pending.flush()

    @property
    def in_flight(self) -> int:
        return len(self._pending)


class GroupReceiver:
    """A trainer rank's end of the buffer."""

    def __init__(self, rollout_ranks: Sequence[int], group: dist.ProcessGroup | None = None):
        self.rollout_ranks = tuple(rollout_ranks)
        self.group = group

    def pull(self, index: int, device: torch.device | str = HOST) -> tuple[Batch, list[dict]]:
        """Batch `index`: this rank's parts from every rollout rank, concatenated in rank order,
        and the metadata that came with them (one dict per rollout rank; {} for ranks that sent
        this trainer rank none)."""
        parts, metas = [], []
        for src in self.rollout_ranks:
            header = torch.empty(4, dtype=torch.int64)
            dist.recv(header, src, group=self.group, tag=TAG_HEADER)
            meta_len, batch_len, got, _ = header.tolist()
            if got != index:
                raise RuntimeError(f"async buffer: expected batch {index} from rank {src}, "
                                   f"received batch {got} (the two sides lost step)")
            payload = torch.empty(meta_len + batch_len, dtype=torch.uint8)
            dist.recv(payload, src, group=self.group, tag=TAG_PAYLOAD)
            metas.append(pickle.loads(payload[:meta_len].numpy().tobytes()))
            parts.append(unpack(payload[meta_len:], device))
        non_empty = [p for p in parts if len(p)]
        batch = Batch.concat(non_empty) if non_empty else max(parts, key=lambda p: len(p.keys()))
        return batch, metas
