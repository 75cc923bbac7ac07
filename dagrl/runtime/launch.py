"""Preparing a run directory and starting the workers.

`prepare_run` resolves the run directory, writes the resolved config there and materialises
built-in artefacts (`builtin:` models and datasets) as ordinary files, so workers only ever
load from disk. `launch` starts the workers: in this process for one worker.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from dagrl.config.loader import dump_yaml
from dagrl.config.schema import Config
from dagrl.data.makers import MAKERS
from dagrl.engines.models import BUILTIN_PREFIX, resolve_builtin_model


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.trainer.run_dir:
        return Path(cfg.trainer.run_dir)
    return Path("runs") / f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def materialize_builtins(cfg: Config, run_dir: Path) -> Config:
    """Write `builtin:` models and datasets under run_dir and return the config pointing at them."""
    m = cfg.model
    model_path = resolve_builtin_model(m.path, run_dir / "artifacts", hidden_size=m.tiny_hidden_size,
                                       layers=m.tiny_layers, seed=cfg.trainer.seed)
    files = []
    for spec in cfg.data.train_files:
        if spec.startswith(BUILTIN_PREFIX):
            name = spec[len(BUILTIN_PREFIX):]
            if name not in MAKERS:
                raise ValueError(f"data.train_files: unknown built-in dataset {spec!r}; choose "
                                 f"one of {', '.join(BUILTIN_PREFIX + k for k in MAKERS)}")
            out = run_dir / "artifacts" / f"{name}-data"
            paths = {"train": out / "train.parquet"}
            if not paths["train"].exists():
                paths = MAKERS[name](out, seed=cfg.trainer.seed)
            files.append(str(paths["train"]))
        else:
            files.append(spec)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(m, path=model_path),
        data=dataclasses.replace(cfg.data, train_files=files),
        trainer=dataclasses.replace(cfg.trainer, run_dir=str(run_dir)))


def prepare_run(cfg: Config) -> Config:
    run_dir = resolve_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))   # as the user configured it
    resolved = materialize_builtins(cfg, run_dir)
    (run_dir / "config.resolved.yaml").write_text(dump_yaml(resolved))
    return resolved


def launch(cfg: Config) -> list[dict[str, float]]:
    """Prepare the run and train. Returns rank 0's per-step metrics."""
    cfg = prepare_run(cfg)
    if cfg.trainer.n_workers != 1:
        raise ValueError("trainer.n_workers > 1 needs the multi-worker launcher")
    from dagrl.runtime.worker import Worker

    return Worker(cfg, Path(cfg.trainer.run_dir)).train()
