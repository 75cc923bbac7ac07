"""Start N workers as Ray actors, one per placement-group bundle (one device each).

The driver holds no sample data: it reserves the bundles, starts the actors, tells them where
rank 0 listens, and waits. If a worker fails, the others are stopped; with
`trainer.max_restarts` > 0 all workers are started again and resume from the newest
checkpoint (`trainer.resume=auto`), otherwise the error is raised here. `RAY_ADDRESS` set:
join that cluster; otherwise start a local Ray instance.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

from dagrl.config.loader import from_dict, to_dict
from dagrl.config.schema import Config
from dagrl.device import device_type, ray_actor_options, ray_bundle
from dagrl.runtime.checkpoint import latest_checkpoint
from dagrl.runtime.process import run_worker_from_env
from dagrl.runtime.run_dir import resolve_run_dir


class WorkerFailed(RuntimeError):
    """A worker process raised or died; the message carries its rank and error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _RayWorker:
    """The actor: environment for torch.distributed, then the common worker body."""

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def run(self, cfg_dict: dict, rank: int, world: int, master: tuple[str, int]) -> list[dict]:
        # Ray gives each actor its own device (visible devices), so it is local rank 0.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        return run_worker_from_env(from_dict(Config, cfg_dict))


def launch_ray(cfg: Config) -> list[dict[str, float]]:
    """Run the workers; restart them all from the last checkpoint after a failure, at most
    trainer.max_restarts times. Returns rank 0's metrics of the last attempt."""
    import ray

    # Every attempt must use the same run directory (and so the same checkpoints).
    run_dir = resolve_run_dir(cfg)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, run_dir=str(run_dir)))
    t = cfg.trainer
    started_here = not ray.is_initialized()
    if started_here:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        else:
            # A local instance: CPU workers may outnumber the cores (each is one process).
            ray.init(num_cpus=max(t.n_workers, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=True)
    try:
        restarts = 0
        while True:
            try:
                return _run_workers(cfg)
            except WorkerFailed as err:
                if restarts == t.max_restarts:
                    raise
                restarts += 1
                last = latest_checkpoint(Path(t.checkpoint_dir or run_dir / "checkpoints"))
                print(f"[dagrl] {err}\n[dagrl] restart {restarts}/{t.max_restarts}: "
                      f"starting all {t.n_workers} workers again from "
                      f"{last or 'the beginning (no checkpoint yet)'}", flush=True)
                if t.resume != "auto":   # continue from what this run wrote, not the start
                    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
                        cfg.trainer, resume="auto"))
    finally:
        if started_here:
            # Let Ray's log monitor forward the workers' last lines before it stops.
            time.sleep(1.0)
            ray.shutdown()


def _run_workers(cfg: Config) -> list[dict[str, float]]:
    """One attempt: a placement group, one actor per rank, wait for all; WorkerFailed if any
    raises or dies (the others are killed: they would wait forever on the failed one)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = cfg.trainer.n_workers
    kind = device_type(cfg.trainer.device)
    pg = placement_group([ray_bundle(kind) for _ in range(n)], strategy="PACK")
    ray.get(pg.ready())
    actor_cls = ray.remote(_RayWorker)
    actors = [actor_cls.options(
        **ray_actor_options(kind), max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)]
    try:
        master = ray.get(actors[0].address.remote())
        cfg_dict = to_dict(cfg)
        pending = {actors[r].run.remote(cfg_dict, r, n, master): r for r in range(n)}
        results: dict[int, list] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done[0])
            try:
                results[rank] = ray.get(done[0])
            except Exception as err:  # RayTaskError / RayActorError carry the remote traceback
                raise WorkerFailed(f"worker rank {rank} failed: {err}") from err
        return results[0]
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)
