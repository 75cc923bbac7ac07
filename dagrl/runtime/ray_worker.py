"""The Ray actor that hosts one worker, and how the driver starts a set of them.

Starting is two rounds, because a worker's environment depends on where its peers landed:

1. every actor reports its placement: node, the accelerator ids Ray gave it, an address;
2. the driver computes each rank's environment from all placements (`device.ray_worker_envs`:
   LOCAL_RANK / LOCAL_WORLD_SIZE per node, the visible-devices variable; RANK, WORLD_SIZE and
   rank 0's address for torch.distributed) and every actor applies it before any library
   initialises the accelerator.

This module imports only what that needs (the worker's own body is imported when it runs), so
an actor that is only placed and configured starts quickly.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

from dagrl.device import (
    ray_actor_options,
    ray_bundle,
    ray_resource,
    ray_worker_envs,
    visible_devices_env,
)
from dagrl.runtime.placement import reserve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayWorker:
    """The actor: placement report, environment, then the common worker body (`run`)."""

    def placement(self, kind: str) -> dict:
        """Where Ray put this actor: node id and IP, the ids of the accelerators of type `kind`
        Ray assigned it and the visible-devices variable as Ray set it, and a free port (used
        as rank 0's rendezvous port)."""
        import ray

        ctx = ray.get_runtime_context()
        resource, var = ray_resource(kind), visible_devices_env(kind)
        ids = ctx.get_accelerator_ids().get(resource, []) if resource else []
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "accelerator_ids": [str(i) for i in ids], "port": _free_port(),
                "ray_visible": os.environ.get(var) if var else None, "pid": os.getpid()}

    def configure(self, env: dict[str, str]) -> dict[str, str | None]:
        """Apply the driver's environment for this rank; returns the variables as this process
        now has them (what torch.distributed, torch and vLLM will read)."""
        os.environ.update(env)
        return {k: os.environ.get(k) for k in env}

    def run(self, cfg_dict: dict, beacon: tuple[str, int],
            console: str | None = None) -> tuple[str, object]:
        """Train as the rank `configure` set: ("ok", metrics), or ("failed", Failure) — a
        worker does not raise into Ray (Ray would print a remote traceback of its own).
        `console`: a file to write standard output to, which the driver prints from."""
        from dagrl.config.loader import from_dict
        from dagrl.config.schema import Config
        from dagrl.runtime.failures import Failure, log_failure
        from dagrl.runtime.process import WorkerState, run_worker_from_env
        from dagrl.runtime.watchdog import ORPHANED_EXIT, orphaned, watch_driver

        state = WorkerState(int(os.environ["RANK"]))
        try:
            watch_driver(beacon)
            with _stdout_to(console):
                return "ok", run_worker_from_env(from_dict(Config, cfg_dict), state=state)
        except BaseException as err:   # noqa: BLE001 — returned to the driver, who reports it
            if orphaned():   # the driver is gone (the watchdog is ending this process)
                os._exit(ORPHANED_EXIT)
            failure = Failure.of(err, state.rank, first=state.first)
            failure.cause_rank = state.cause_rank
            log_failure(state.run_dir, failure)
            return "failed", failure


@contextlib.contextmanager
def _stdout_to(path: str | None) -> Iterator[None]:
    """Standard output appended to `path`, a line at a time (several workers may share it: a
    line written with O_APPEND lands whole)."""
    if path is None:
        yield
        return
    with open(path, "a", buffering=1) as f, contextlib.redirect_stdout(f):
        yield


@dataclass
class Workers:
    """A started set of worker actors, ready to run: their placement group, the actors in rank
    order, where each landed and the environment each one now has."""
    pg: object
    actors: list
    placements: list[dict] = field(default_factory=list)
    envs: list[dict[str, str | None]] = field(default_factory=list)

    def nodes(self) -> dict[str, list[int]]:
        """node id -> the ranks on it."""
        out: dict[str, list[int]] = {}
        for rank, p in enumerate(self.placements):
            out.setdefault(p["node_id"], []).append(rank)
        return out

    def describe(self) -> str:
        """One line for the log: which ranks run on which node."""
        nodes = self.nodes()
        parts = [f"node {node[:8]} ({self.placements[ranks[0]]['ip']}): ranks "
                 f"{','.join(map(str, ranks))}" for node, ranks in nodes.items()]
        return f"{len(self.actors)} worker(s) on {len(nodes)} node(s): " + "; ".join(parts)

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)


def start_workers(kind: str, n: int, strategy: str = "PACK",
                  timeout_s: float = 300.0) -> Workers:
    """Reserve `n` bundles for device type `kind`, start one actor per bundle and give each its
    environment (module docstring). Raises PlacementError when the cluster lacks the
    resources for `timeout_s` seconds."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = reserve([ray_bundle(kind) for _ in range(n)], strategy, timeout_s)
    actor_cls = ray.remote(RayWorker)
    actors = [actor_cls.options(
        **ray_actor_options(kind), max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)]
    workers = Workers(pg, actors)
    try:
        workers.placements = ray.get([a.placement.remote(kind) for a in actors])
        device_envs = ray_worker_envs(kind, [(p["node_id"], p["accelerator_ids"])
                                             for p in workers.placements])
        master = workers.placements[0]
        envs = [{"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": master["ip"],
                 "MASTER_PORT": str(master["port"]), **device_envs[r]} for r in range(n)]
        workers.envs = ray.get([a.configure.remote(env) for a, env in zip(actors, envs,
                                                                           strict=True)])
    except BaseException:
        workers.stop()
        raise
    return workers

