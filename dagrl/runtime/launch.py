"""Starting the workers. Three ways to start the same workers:

  trainer.n_workers=1   in this process, no process group;
  trainer.n_workers=N   N Ray actors in a placement group (runtime/ray_launcher.py);
  torchrun ... -m dagrl.train   one worker per torchrun process (runtime/process.py).
"""

from __future__ import annotations

from dagrl.config.schema import Config
from dagrl.runtime.ray_launcher import launch_ray
from dagrl.runtime.run_dir import prepare_run
from dagrl.runtime.worker import Worker


def launch(cfg: Config) -> list[dict[str, float]]:
    """Start the configured number of workers and train. Returns the per-step metrics."""
    if cfg.trainer.n_workers > 1:
        return launch_ray(cfg)
    return Worker(prepare_run(cfg)).train()
