"""The run directory: resolved, proven writable, and filled before any worker starts.

`prepare_run` resolves the run directory, writes the resolved config there and materialises
built-in artefacts (`builtin:` models and datasets) as ordinary files, so workers only ever
load from disk. It runs on rank 0, which then hands the resolved config to the other ranks.
The built-in models' code (torch, transformers) is imported only where they are written: the
launcher imports this module before its input checks, which must not wait seconds for it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from dagrl.config.loader import dump_yaml
from dagrl.config.model_source import BUILTIN_PREFIX, TINY_REWARD_MODEL
from dagrl.config.schema import Config
from dagrl.data.makers import MAKERS


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.trainer.run_dir:
        return Path(cfg.trainer.run_dir)
    return Path("runs") / f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def with_run_dir(cfg: Config, run_dir: Path | str) -> Config:
    """`cfg` with trainer.run_dir set (a default directory name holds the time: resolve it
    once and pass the result on)."""
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer,
                                                                run_dir=str(run_dir)))


def resolve_builtin_reward_model(path: str, out_root: Path, *, seed: int) -> str:
    """`builtin:tiny-digit-rm` -> the tiny reward model written under `out_root` (trained once
    into the cache: dagrl/engines/tiny_reward_model.py); other paths pass through."""
    if not path.startswith(BUILTIN_PREFIX):
        return path
    if path != BUILTIN_PREFIX + TINY_REWARD_MODEL:
        raise ValueError(f"reward_model.path: unknown built-in reward model {path!r}; the only "
                         f"one is {BUILTIN_PREFIX + TINY_REWARD_MODEL}")
    out = out_root / f"{TINY_REWARD_MODEL}-s{seed}"
    if not (out / "config.json").exists():
        from dagrl.engines.tiny_reward_model import copy_tiny_digit_rm

        copy_tiny_digit_rm(out, seed=seed)
    return str(out)


def materialize_builtins(cfg: Config, run_dir: Path) -> Config:
    """Write `builtin:` models and datasets under run_dir and return the config pointing at them."""
    from dagrl.engines.models import resolve_builtin_model

    m = cfg.model
    model_path = resolve_builtin_model(m.path, run_dir / "artifacts",
                                       hidden_size=m.tiny_hidden_size, layers=m.tiny_layers,
                                       seed=cfg.trainer.seed, heads=m.tiny_heads)

    def data_file(spec: str, key: str, split: str) -> str:
        if not spec.startswith(BUILTIN_PREFIX):
            return spec
        name = spec[len(BUILTIN_PREFIX):]
        if name not in MAKERS:
            raise ValueError(f"data.{key}: unknown built-in dataset {spec!r}; choose one of "
                             f"{', '.join(BUILTIN_PREFIX + k for k in MAKERS)}")
        out = run_dir / "artifacts" / f"{name}-data"
        path = out / f"{split}.parquet"
        if not path.exists():
            path = MAKERS[name](out, seed=cfg.trainer.seed)[split]
        return str(path)

    models = {}   # extra policies (config/models.py) whose own model.path is a built-in
    for name, overlay in cfg.models.items():
        own = cfg.derived_models[name].model
        path = (overlay.get("model") or {}).get("path")
        if path:
            overlay = {**overlay, "model": {**overlay["model"], "path": resolve_builtin_model(
                path, run_dir / "artifacts", hidden_size=own.tiny_hidden_size,
                layers=own.tiny_layers, seed=cfg.trainer.seed, heads=own.tiny_heads)}}
        models[name] = overlay
    d = cfg.data
    return dataclasses.replace(
        cfg, model=dataclasses.replace(m, path=model_path), models=models,
        reward_model=dataclasses.replace(cfg.reward_model, path=resolve_builtin_reward_model(
            cfg.reward_model.path, run_dir / "artifacts", seed=cfg.trainer.seed)),
        judge=dataclasses.replace(cfg.judge, path=resolve_builtin_model(
            cfg.judge.path, run_dir / "artifacts", hidden_size=m.tiny_hidden_size,
            layers=m.tiny_layers, seed=cfg.trainer.seed + 1, heads=m.tiny_heads)
            if cfg.judge.path else ""),
        data=dataclasses.replace(
            d, train_files=[data_file(s, "train_files", "train") for s in d.train_files],
            val_files=[data_file(s, "val_files", "test") for s in d.val_files]),
        trainer=dataclasses.replace(cfg.trainer, run_dir=str(run_dir)))


class RunDirError(OSError):
    """The run directory cannot be created or written."""


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` and prove a file can be written there, before any work is done."""
    probe = run_dir / ".write-test"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise RunDirError(f"trainer.run_dir={str(run_dir)!r} cannot be written "
                          f"({err.strerror or err}); choose another directory") from err


def prepare_run(cfg: Config) -> Config:
    run_dir = resolve_run_dir(cfg)
    check_writable(run_dir)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))   # as the user configured it
    resolved = materialize_builtins(cfg, run_dir)
    (run_dir / "config.resolved.yaml").write_text(dump_yaml(resolved))
    return resolved


def write_pid_file(run_dir: Path, rank: int) -> None:
    """`<run_dir>/workers/rank<r>.pid`: which process is which rank (to inspect or signal)."""
    workers = run_dir / "workers"
    workers.mkdir(exist_ok=True)
    (workers / f"rank{rank}.pid").write_text(str(os.getpid()))


def announce_run_dir(run_dir: Path, finished: bool = False) -> None:
    """Say where the run writes, when it starts and again when it ends (the bar and the step
    lines in between push the first line out of sight)."""
    if not finished:
        print(f"[dagrl] run directory: {run_dir}", flush=True)
        return
    has_checkpoints = any((run_dir / "checkpoints").glob("step_*"))
    export = (f"dagrl export {run_dir} --out DIR" if has_checkpoints
              else "no checkpoint: trainer.save_final=true writes one after the last step")
    print(f"[dagrl] done; run directory: {run_dir} (dagrl report {run_dir}; {export})",
          flush=True)
