"""The body of every distributed worker process (a torchrun process or a Ray actor): join the
process group the environment describes, let rank 0 prepare the run directory, train.
"""

from __future__ import annotations

from pathlib import Path

from dagrl.config.loader import from_dict, to_dict
from dagrl.config.schema import Config
from dagrl.runtime.distributed import init_distributed, shutdown
from dagrl.runtime.run_dir import prepare_run, write_pid_file
from dagrl.runtime.worker import Worker


def run_worker_from_env(cfg: Config) -> list[dict[str, float]]:
    """The body of every distributed worker process (torchrun or a Ray actor): join the group,
    let rank 0 prepare the run, train. Returns the per-step metrics (the same on every rank)."""
    ctx = init_distributed(cfg.trainer.device)
    try:
        if ctx.world_size != cfg.trainer.n_workers:
            # The launcher's world size wins (torchrun --nproc-per-node); re-check the config.
            data = to_dict(cfg)
            data["trainer"]["n_workers"] = ctx.world_size
            cfg = from_dict(Config, data)
        resolved = prepare_run(cfg) if ctx.rank == 0 else None
        resolved = ctx.broadcast_object(resolved)
        write_pid_file(Path(resolved.trainer.run_dir), ctx.rank)
        history = Worker(resolved, ctx).train()
        # Every rank finishes its last collective before any rank tears its connections down:
        # a rank destroying its group while a peer still talks to it can abort the peer (seen
        # once under torchrun as `terminate called without an active exception` at exit).
        # Only on success: after a failure the peers may never reach a barrier.
        ctx.barrier()
        return history
    finally:
        shutdown()
