"""Starting the workers. Three ways to start the same workers:

  trainer.n_workers=1   in this process, no process group;
  trainer.n_workers=N   N Ray actors in a placement group (runtime/ray_launcher.py);
  torchrun ... -m dagrl.train   one worker per torchrun process (runtime/process.py).

Before any of them: the inputs are checked (runtime/input_checks.py) while nothing has been
written, then the run directory is locked (runtime/run_lock.py) — a refused run leaves no trace
and a second live run on the same directory is refused. The workers' code (torch, the models,
Ray) is imported after the checks, so a refusal does not wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dagrl.config.schema import Config
from dagrl.runtime.failures import Failure, WorkerFailed, log_failure, run_log_path, sigterm_exits
from dagrl.runtime.input_checks import check_inputs
from dagrl.runtime.run_dir import announce_run_dir, prepare_run, resolve_run_dir, with_run_dir
from dagrl.runtime.run_lock import RunLock, announce_takeover


@dataclass
class Outcome:
    """Where a launch got to, for reporting its failure: the run directory, and the log that
    holds the traceback (None: nothing was logged, e.g. the inputs were refused)."""
    run_dir: Path | None = None
    log: Path | None = None


def launch(cfg: Config, outcome: Outcome | None = None) -> list[dict[str, float]]:
    """Check the inputs, lock the run directory, start the configured number of workers and
    train. Returns the per-step metrics; raises the failure (its traceback logged)."""
    outcome = outcome if outcome is not None else Outcome()
    cfg = with_run_dir(cfg, resolve_run_dir(cfg))   # a default name holds the time: once
    outcome.run_dir = Path(cfg.trainer.run_dir)
    check_inputs(cfg)
    with sigterm_exits(), RunLock(outcome.run_dir) as lock:
        announce_takeover(lock)
        announce_run_dir(outcome.run_dir)
        history = _train(cfg, outcome)
    announce_run_dir(outcome.run_dir, finished=True)
    return history


def _train(cfg: Config, outcome: Outcome) -> list[dict[str, float]]:
    from dagrl.runtime.distributed import init_distributed
    from dagrl.runtime.ray_launcher import launch_ray
    from dagrl.runtime.worker import Worker

    if cfg.trainer.n_workers > 1:
        try:
            return launch_ray(cfg)
        except WorkerFailed:
            outcome.log = run_log_path(outcome.run_dir)   # each worker logged its own
            raise
    try:
        # The worker's device comes from trainer.device (auto: the accelerator if any), as
        # under Ray and torchrun; a bare Worker(cfg) would train on the host.
        return Worker(prepare_run(cfg), init_distributed(cfg.trainer.device)).train()
    except Exception as err:
        outcome.log = log_failure(outcome.run_dir, Failure.of(err))
        raise
