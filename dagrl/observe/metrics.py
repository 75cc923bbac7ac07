"""Per-step metrics that reduce exactly across workers.

A node records *sufficient statistics* (sums and counts, minima, maxima) for its metrics on its
own shard; at the end of the step one reduction per kind (sum / max / min) over all ranks turns
them into global values. A mean recorded as (Σx, n) is the exact global mean, not a mean of
per-rank means; a std is derived from Σx and Σx².
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist


class StepMetrics:
    """Accumulates one step's metrics on one rank; `reduce` returns the global values."""

    def __init__(self) -> None:
        # All sum-reduced statistics live in one dict, keyed "<kind>:<name>": "s" plain sums,
        # "mt"/"mc" a mean's total and count, "q" a distribution's sum of squares.
        self._sum: dict[str, float] = defaultdict(float)
        self._max: dict[str, float] = {}
        self._min: dict[str, float] = {}

    def add_sum(self, name: str, value: float) -> None:
        """A global sum: Σ over ranks and calls."""
        self._sum["s:" + name] += float(value)

    def add_mean(self, name: str, total: float, count: float) -> None:
        """A global mean Σtotal / Σcount over ranks and calls (e.g. token sums and token counts)."""
        self._sum["mt:" + name] += float(total)
        self._sum["mc:" + name] += float(count)

    def add_max(self, name: str, value: float) -> None:
        self._max[name] = max(self._max.get(name, -math.inf), float(value))

    def add_min(self, name: str, value: float) -> None:
        self._min[name] = min(self._min.get(name, math.inf), float(value))

    def merge(self, other: StepMetrics) -> None:
        """Add `other`'s statistics to these, as if they had been recorded here (a node's
        metrics recorded apart, e.g. on the ranks of a tensor-parallel replica, which count
        once; the async trainer merges the rollout side's metrics that came with a batch)."""
        for key, value in other._sum.items():
            self._sum[key] += value
        for name, value in other._max.items():
            self.add_max(name, value)
        for name, value in other._min.items():
            self.add_min(name, value)

    def add_distribution(self, name: str, values: torch.Tensor) -> None:
        """name/mean, name/std (population), name/max, name/min of all values on all ranks."""
        values = values.detach().double().flatten()
        self.add_mean(name + "/mean", float(values.sum()), values.numel())
        self._sum["q:" + name] += float((values * values).sum())
        if values.numel():
            self.add_max(name + "/max", float(values.max()))
            self.add_min(name + "/min", float(values.min()))

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Combine across the ranks of `group` (no-op when not distributed). Every rank must
        call it; ranks may have recorded different names (e.g. a node that ran on a subset)."""
        sums, maxs, mins = dict(self._sum), dict(self._max), dict(self._min)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            sums = _all_reduce_dict(sums, dist.ReduceOp.SUM, group)
            maxs = _all_reduce_dict(maxs, dist.ReduceOp.MAX, group)
            mins = _all_reduce_dict(mins, dist.ReduceOp.MIN, group)
        out: dict[str, float] = {}
        for key, value in sums.items():
            kind, name = key.split(":", 1)
            if kind == "s":
                out[name] = value
            elif kind == "mt":
                count = sums["mc:" + name]
                out[name] = value / count if count else float("nan")
            elif kind == "q":
                count = sums["mc:" + name + "/mean"]
                if count:
                    mean = sums["mt:" + name + "/mean"] / count
                    out[name + "/std"] = math.sqrt(max(value / count - mean * mean, 0.0))
        out.update(maxs)
        out.update(mins)
        return dict(sorted(out.items()))


def _all_reduce_dict(values: dict[str, float], op: dist.ReduceOp,
                     group: dist.ProcessGroup | None) -> dict[str, float]:
    """All-reduce a name -> float dict whose key sets may differ between ranks."""
    names: list[list[str]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(names, sorted(values), group=group)
    keys = sorted(set().union(*names))
    fill = {dist.ReduceOp.SUM: 0.0, dist.ReduceOp.MAX: -math.inf, dist.ReduceOp.MIN: math.inf}[op]
    # Metrics are reduced on the CPU: a handful of floats, and gloo is always available.
    t = torch.tensor([values.get(k, fill) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return dict(zip(keys, t.tolist(), strict=True))
