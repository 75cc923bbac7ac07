"""Where a worker's step gets its batch and where the batch goes: the parts of the loop that
differ between placements (runtime/sides.py). The loop itself is one (runtime/worker.py):

    batch = source.next_batch(step)        prompts | scored groups from the rollout ranks
    batch = the placement's tasks (batch)  the same roles, reshards and balances
    sink.finish(step, batch)               reduce + log the metrics | push the groups on

    placement        source                           sink
    sync (all)       PromptSource                     MetricsSink
    async rollout    PromptSource gated by weights    GroupSink (to the trainer ranks)
    async trainer    GroupSource (from rollout ranks) MetricsSink

Async versions: the policy version v is the number of training steps taken. The trainer's step
t updates version t-1 on the batch generated for step t, then sends version t
(engines/weight_channel.py). The rollout ranks generate the batch of step t only once they hold
version >= t-1-max_staleness (they wait for it: `async/rollout_wait_s`), and take any newer
version that has arrived between requests (or, with partial rollout, between chunks), so every
token of the batch of step t was drawn by a version in [t-1-max_staleness, t-1]; the trainer
checks it. Sampling seeds are keyed by step as in sync mode, so with max_staleness=0 and no
partial rollout each batch is the sync run's.

Multi-turn episodes wait on their tools; while the batch of step t does, the rollout ranks may
start the batch of step t+1 (`next_prompts`, rollout.multi_turn.look_ahead) once they hold
version >= t-max_staleness, the same bound: a long tool call then stalls one batch, not the
pipeline.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dagrl.data.async_buffer import GroupReceiver, GroupSender
from dagrl.data.batch import Batch
from dagrl.data.dataset import PromptLoader
from dagrl.engines.weight_channel import WeightReceiver, policy_tag
from dagrl.observe.metrics import StepMetrics
from dagrl.runtime.sides import Side


class PromptSource:
    """A step's prompts, read by this rank from its shard of the dataset."""

    can_give_more = True   # DAPO's filter may ask for more prompts within the step
    generates_ahead = False   # the next step's prompts need this step's update first

    def __init__(self, loader: PromptLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def begin(self, start: int, position: dict | None) -> None:
        if position is not None:
            self.loader.load_state_dict(position)

    def next_batch(self, step: int, metrics: StepMetrics) -> Batch:
        return self.more()

    def more(self) -> Batch:
        return self.loader.next_batch().to(self.device)

    def position(self) -> dict:
        """Where the data continues (a checkpoint's)."""
        return self.loader.state_dict()

    def end(self) -> None:
        pass


class FreshWeightsPromptSource(PromptSource):
    """The async rollout side's prompts: a step's batch is read only once the rollout engines
    hold weights at most `max_staleness` versions behind the step's. The weights come from the
    trainer's lead rank (engines/weight_channel.py) into `engines`, one per trained policy (the
    main one first, then each of `models`: a channel each, in lockstep, since every training
    step updates every policy); newer versions are taken between requests and, with partial
    rollout, between chunks (`between_chunks`)."""

    generates_ahead = True

    def __init__(self, loader: PromptLoader, device: torch.device, engines: list, *,
                 source_rank: int, dtype: torch.dtype, last_version: int, max_staleness: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__(loader, device)
        self.engines, self.source_rank, self.dtype = engines, source_rank, dtype
        self.last_version, self.max_staleness, self.group = last_version, max_staleness, group
        self.receivers: list[WeightReceiver] = []
        self.loads_mid_request = 0   # versions loaded between chunks during this step

    @property
    def version(self) -> int:
        """The policy version every engine holds (the oldest of them)."""
        return min(r.version for r in self.receivers)

    def begin(self, start: int, position: dict | None) -> None:
        super().begin(start, position)
        # The trainer's lead sends each policy's layout, then its weights of `start` (the
        # checkpoint's), policy after policy.
        for i, engine in enumerate(self.engines):
            receiver = WeightReceiver(engine, self.source_rank, dtype=self.dtype,
                                      last_version=self.last_version, group=self.group,
                                      tag=policy_tag(i))
            receiver.wait_for(start)
            self.receivers.append(receiver)

    def _poll_all(self) -> bool:
        return any([r.poll_all() for r in self.receivers])   # a list: poll every one

    def next_batch(self, step: int, metrics: StepMetrics) -> Batch:
        began = time.perf_counter()
        self._poll_all()                          # between requests: the newest weights
        needed = step - 1 - self.max_staleness
        waited = 0.0
        if self.version < needed:                 # too stale: wait for the trainer
            for receiver in self.receivers:
                receiver.wait_for(needed)
            waited = time.perf_counter() - began
        metrics.add_sum("async/rollout_wait_s", waited)
        metrics.add_mean("async/rollout_version_lag", step - 1 - self.version, 1.0)
        self.loads_mid_request = 0
        return self.more()

    def next_prompts(self, step: int) -> Batch | None:
        """The prompts of step+1 if the engines may generate them now: there is such a step,
        and with the newest weights (loaded here, between turns of step `step`) they hold a
        version fresh enough for it. The loader is left where it was, so step+1 reads the
        same prompts again (a resume too), whether or not they were started ahead."""
        if step > self.last_version:   # step+1 would be past the run's last step
            return None
        if self._poll_all():
            self.loads_mid_request += 1
        if self.version < step - self.max_staleness:
            return None
        position = self.loader.state_dict()
        prompts = self.more()
        self.loader.load_state_dict(position)
        return prompts

    def between_chunks(self) -> None:
        if self._poll_all():
            self.loads_mid_request += 1

    def end(self) -> None:
        for receiver in self.receivers:   # the trainer sends until its last version
            while receiver.expecting:
                receiver.wait_for(receiver.version + 1)


class GroupSource:
    """The async trainer side's batches: this rank's share of the groups every rollout rank
    generated and scored for the step, with their metrics and data position."""

    can_give_more = False   # it reads no prompts: no `more()` within a step
    generates_ahead = False

    def __init__(self, rollout_ranks: tuple[int, ...], group: dist.ProcessGroup | None,
                 device: torch.device, max_staleness: int) -> None:
        self.receiver = GroupReceiver(rollout_ranks, group=group)
        self.device, self.max_staleness = device, max_staleness
        self._position: dict | None = None

    def begin(self, start: int, position: dict | None) -> None:
        self._position = position

    def next_batch(self, step: int, metrics: StepMetrics) -> Batch:
        began = time.perf_counter()
        batch, metas = self.receiver.pull(step, self.device)
        metrics.add_max("async/trainer_wait_s", time.perf_counter() - began)
        for meta in metas:
            if "metrics" in meta:
                metrics.merge(meta["metrics"])
            if "loader" in meta:
                self._position = meta["loader"]
        check_staleness(batch, step, self.max_staleness, metrics)
        return batch

    def position(self) -> dict | None:
        """The data position of the last groups pulled: a resume generates from there."""
        return self._position

    def end(self) -> None:
        pass


class MetricsSink:
    """Sync ranks and async trainer ranks: the step's metrics reduced over the side's ranks
    (rank 0 / the side's lead then logs them)."""

    def __init__(self, side: Side, observer) -> None:
        self.side, self.observer = side, observer

    def finish(self, step: int, batch: Batch, metrics: StepMetrics,
               seconds: float) -> dict[str, float]:
        metrics.add_max("timing/step_s", seconds)
        # Over the side's ranks only (a side's group, never None in async mode: that would be
        # the world, the other side included).
        return self.observer.finish_step(step, metrics.reduce(self.side.cpu_group))

    def end(self) -> None:
        pass


class GroupSink:
    """The async rollout side: the step's scored groups, its metrics and the data position go
    to the trainer ranks (data/async_buffer.py); the call returns without waiting."""

    def __init__(self, trainer_ranks: tuple[int, ...], group: dist.ProcessGroup | None,
                 source: FreshWeightsPromptSource) -> None:
        self.sender = GroupSender(trainer_ranks, group=group)
        self.source = source

    def finish(self, step: int, batch: Batch, metrics: StepMetrics, seconds: float) -> None:
        metrics.add_sum("async/weight_loads_mid_request", self.source.loads_mid_request)
        metrics.add_max("timing/rollout_side_s", seconds)
        self.sender.push(batch, step, {"metrics": metrics, "loader": self.source.position()})

    def end(self) -> None:
        self.sender.flush()


def check_staleness(batch: Batch, step: int, bound: int, metrics: StepMetrics) -> None:
    """Per response token: the updates between the policy that drew it and the one trained now
    (version step-1). Beyond the bound is a bug, not a statistic."""
    mask = batch["response_mask"].bool()
    lag = (step - 1 - batch["token_versions"])[mask].double()   # [tokens]
    if len(lag) and (float(lag.max()) > bound or float(lag.min()) < 0):
        raise RuntimeError(f"async: the batch of step {step} holds tokens {int(lag.max())} "
                           f"versions old, beyond rollout.max_staleness={bound}")
    metrics.add_mean("async/staleness_mean", float(lag.sum()), len(lag))
    if len(lag):
        metrics.add_max("async/staleness_max", float(lag.max()))
    versions = batch["token_versions"].masked_fill(~mask, 2**62)
    mixed = (versions.min(-1).values != batch["token_versions"].max(-1).values) & mask.any(-1)
    metrics.add_mean("async/partial_samples_fraction", float(mixed.sum()), len(batch))
