"""Optional metric loggers, each through its own library: TensorBoard, wandb, MLflow.

Each is installed as an extra (`pip install 'dagrl[tensorboard]'`, `[wandb]`, `[mlflow]`) and
imported only when `logging.backends` selects it; a missing library is an error naming the
extra. All three write inside the run directory by default:
  tensorboard   RUN_DIR/tensorboard/events.out.tfevents.*
  wandb         RUN_DIR/wandb/offline-run-*/ (logging.wandb_mode=offline, the default: no
                network; `wandb sync` uploads it later) or online
  mlflow        RUN_DIR/mlruns (a local file store), or logging.mlflow_tracking_uri
Non-finite values are left out (none of the three stores NaN consistently).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import time
from pathlib import Path
from typing import Any

from dagrl.config.schema import LoggingConfig
from dagrl.extras import MissingExtraError


def require(module: str, extra: str):
    """Import `module`, or raise naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f"logging.backends includes {extra!r} but the {module!r} package is not installed: "
            f"pip install 'dagrl[{extra}]'") from err


# logging.backends -> the package each needs (console and jsonl need none).
BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_backends_installed(cfg: LoggingConfig) -> None:
    """Each selected backend's package can be imported (found, not imported: wandb's import
    alone takes seconds); raised by the pre-flight, before anything is written."""
    for backend in cfg.backends:
        package = BACKEND_PACKAGES.get(backend)
        if package is not None and importlib.util.find_spec(package) is None:
            raise MissingExtraError(
                f"logging.backends includes {backend!r} but the {package!r} package is not "
                f"installed: pip install 'dagrl[{backend}]' (or leave {backend!r} out)")


def finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(v)}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'actor': {'lr': 1}} -> {'actor.lr': 1}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardLogger:
    def __init__(self, run_dir: Path, config: dict | None) -> None:
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if config:
            import yaml

            # Indented four spaces: TensorBoard renders text as markdown, this keeps it verbatim.
            text = yaml.safe_dump(config, sort_keys=False)
            self.writer.add_text("config", "\n".join("    " + x for x in text.splitlines()))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in finite(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, config: dict | None) -> None:
        wandb = require("wandb", "wandb")
        # No prompts, no git probing, no console capture: a training job is not interactive.
        os.environ.setdefault("WANDB_SILENT", "true")
        settings = wandb.Settings(mode=cfg.wandb_mode, silent=True, console="off",
                                  disable_git=True, save_code=False)
        self.run = wandb.init(project=cfg.project, name=cfg.run_name or run_dir.name,
                              dir=str(run_dir), config=config or {}, settings=settings)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, config: dict | None) -> None:
        require("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = cfg.mlflow_tracking_uri
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses file stores unless asked (it steers users to a database); a
            # directory in the run needs no server or database driver, so we ask.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # A client, not mlflow's module-level active run: nothing global to leak between runs.
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(cfg.project)
        experiment = found.experiment_id if found else self.client.create_experiment(cfg.project)
        self.run_id = self.client.create_run(
            experiment, run_name=cfg.run_name or run_dir.name).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flatten(config or {}).items()]
        for i in range(0, len(params), 100):     # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(k, v, now, step) for k, v in finite(metrics).items()]
        for i in range(0, len(batch), 1000):     # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
