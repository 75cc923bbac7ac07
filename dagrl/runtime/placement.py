"""Reserving the devices of a Ray run, and what to say when the cluster does not have them.

`reserve(bundles, strategy, timeout_s)` asks Ray for one placement-group bundle per worker and
waits at most `timeout_s` for it. Ray's own `pg.ready()` waits forever when a resource does not
exist in the cluster (an accelerator bundle on a CPU-only cluster, Ascend's resource on nodes
that register another accelerator), which looks like a hung run; here the wait ends in a
`PlacementError` naming, for each resource, how much the run needs, how much the cluster has
and how much is free now.
"""

from __future__ import annotations

from collections.abc import Sequence


class PlacementError(RuntimeError):
    """The cluster could not give the run its workers' resources in time."""


def shortfall(bundles: Sequence[dict[str, float]], total: dict[str, float],
              available: dict[str, float]) -> list[str]:
    """One phrase per resource the run needs more of than the cluster has, or has free."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    out = []
    for name, amount in needed.items():
        have, free = total.get(name, 0.0), available.get(name, 0.0)
        if have < amount:
            out.append(f"{name}: needs {amount:g}, the cluster has {have:g}")
        elif free < amount:
            out.append(f"{name}: needs {amount:g}, the cluster has {have:g} but only {free:g} "
                       f"free (other jobs hold the rest)")
    return out


def describe(bundles: Sequence[dict[str, float]], strategy: str, timeout_s: float,
             total: dict[str, float], available: dict[str, float]) -> str:
    """The message of a placement that timed out."""
    each = ", ".join(f"{k}: {v:g}" for k, v in bundles[0].items()) if bundles else "nothing"
    missing = shortfall(bundles, total, available)
    why = ("; ".join(missing) if missing else
           f"the cluster has enough in total, but not on nodes that fit strategy {strategy} "
           f"(trainer.placement_strategy)")
    return (f"Ray could not place {len(bundles)} worker(s) ({{{each}}} each) within "
            f"{timeout_s:g} s (trainer.placement_timeout_s): {why}")


def reserve(bundles: list[dict[str, float]], strategy: str, timeout_s: float):
    """A ready placement group of `bundles`, or PlacementError after `timeout_s` seconds."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(describe(bundles, strategy, timeout_s, ray.cluster_resources(),
                                      ray.available_resources())) from None
    return pg
