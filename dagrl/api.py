"""dagrl from Python: `dagrl.train(...)`, where a TRL user writes `GRPOTrainer(...).train()`.

    import dagrl

    def reward(data_source, solution_str, ground_truth, extra_info=None):   # verl's signature
        return float(solution_str.strip() == ground_truth)

    rows = [{"prompt": [{"role": "user", "content": "2+3="}], "data_source": "sums",
             "reward_model": {"ground_truth": "5"}}, ...]          # verl's row layout
    result = dagrl.train(reward_fn=reward, train_dataset=rows, trainer__total_steps=20)
    result.final["reward/mean"], result.run_dir, result.checkpoint

`config` is a YAML file (as `dagrl train` takes) or a nested dict; keyword overrides use `__`
for the dots of `dagrl train`'s `a.b=c` (`actor__lr=1e-5`). Datasets are a `datasets.Dataset`,
a pandas DataFrame or a list of dicts, written as parquet into the run directory (the run can
be resumed and inspected like any other). Errors raise (`ConfigError` for a bad config or
input, the worker's exception for a failed run); nothing calls `sys.exit`.

`reward_fn` is a per-sample callable with verl's signature. One defined in an importable
module reaches every worker and the reward processes by its import path; one defined in a
notebook or a script's `__main__` cannot be imported elsewhere, so it runs in this process:
one worker and `reward.num_workers=0`, or a ConfigError naming the fix.
"""

from __future__ import annotations

import importlib
import inspect
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dagrl.config.loader import ConfigError
from dagrl.config.schema import Config

# The datasets handed over as Python objects, written as parquet in the run directory.
INPUTS = "inputs"


@dataclass
class RunResult:
    run_dir: Path
    metrics: list[dict[str, float]]     # one dict per step run by this call
    checkpoint: Path | None             # the newest checkpoint (None: trainer.save_final=false)

    @property
    def final(self) -> dict[str, float]:
        """The last step's metrics."""
        return self.metrics[-1] if self.metrics else {}


def train(config: str | Path | Mapping[str, Any] | None = None, *,
          reward_fn: Callable[..., Any] | None = None, train_dataset: Any = None,
          val_dataset: Any = None, **overrides: Any) -> RunResult:
    """Train as `dagrl train CONFIG key=value ...` does, from Python; returns the run."""
    from dagrl.config.loader import render_value
    from dagrl.runtime.launch import Outcome, launch
    from dagrl.runtime.run_dir import resolve_run_dir, with_run_dir

    items = [f"{key.replace('__', '.')}={render_value(value)}" for key, value in overrides.items()]
    cfg = _load(config, items)
    run_dir = resolve_run_dir(cfg)
    data = {"reward.custom_fn": _reward_spec(reward_fn, cfg)} if reward_fn is not None else {}
    created = not run_dir.exists()
    try:
        for key, dataset in (("train_files", train_dataset), ("val_files", val_dataset)):
            if dataset is not None:
                path = _write_rows(dataset, run_dir / INPUTS / f"{key.split('_')[0]}.parquet",
                                   key)
                data[f"data.{key}"] = f"[{path}]"
        cfg = _load(config, [*items, *(f"{k}={v}" for k, v in data.items())])
        outcome = Outcome()
        metrics = launch(with_run_dir(cfg, run_dir), outcome)
    except BaseException:
        # A run refused before it started leaves nothing behind: not even the data written
        # for it (a run that started keeps its directory, to be read or resumed).
        if created and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {INPUTS}:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return RunResult(outcome.run_dir, metrics, _newest_checkpoint(cfg, outcome.run_dir))


def _load(config: str | Path | Mapping[str, Any] | None, items: list[str]) -> Config:
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.config_names import check_config_names

    cfg = load_run_config(config, items)   # a YAML path or a nested dict, as the CLI's file
    check_config_names(cfg)
    return cfg


def _rows(dataset: Any, key: str) -> list[dict]:
    if isinstance(dataset, list):
        rows = dataset
    elif hasattr(dataset, "to_list"):            # datasets.Dataset
        rows = dataset.to_list()
    elif hasattr(dataset, "to_dict"):            # pandas.DataFrame
        rows = dataset.to_dict("records")
    else:
        raise ConfigError(f"{key}: expected a datasets.Dataset, a pandas DataFrame or a list of "
                          f"dicts, got {type(dataset).__name__}")
    if not rows:
        raise ConfigError(f"{key}: the dataset has no rows")
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, Mapping)), None)
    if bad is not None:
        raise ConfigError(f"{key}: row {bad} is a {type(rows[bad]).__name__}, not a dict in "
                          "verl's layout (prompt, data_source, reward_model.ground_truth)")
    return rows


def _write_rows(dataset: Any, path: Path, key: str) -> Path:
    import pyarrow as pa

    from dagrl.data.parquet_write import write_parquet_atomic

    rows = _rows(dataset, key)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ConfigError(f"{key}: the rows do not form one table ({err})") from err
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_parquet_atomic(table, path, row_group_size=1024)


def _reward_spec(fn: Callable[..., Any], cfg: Config) -> str:
    """An import path every process resolves, or (this process only) an in-process spec."""
    from dagrl.rewards.custom import in_process_spec

    if not callable(fn):
        raise ConfigError(f"reward_fn: {fn!r} is not callable")
    if "completions" in _parameters(fn):
        raise ConfigError(
            f"reward_fn {getattr(fn, '__qualname__', fn)!r} takes TRL's batch arguments "
            "(prompts, completions, **columns); dagrl calls it once per sample as verl's "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float "
            "(docs/coming-from-trl.md)")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is fn:
            return f"{module}:{qualname}"
    where = f"{qualname or fn!r} (defined in {module or 'this process'})"
    if cfg.trainer.n_workers > 1 or cfg.reward.num_workers > 0:
        raise ConfigError(
            f"reward_fn {where} cannot be imported by other processes, and "
            f"trainer.n_workers={cfg.trainer.n_workers}, reward.num_workers="
            f"{cfg.reward.num_workers} run it in others: define it in a module file (e.g. "
            "my_rewards.py, then `from my_rewards import reward`), or train with one worker "
            "and reward.num_workers=0")
    return in_process_spec(fn)


def _parameters(fn: Callable[..., Any]) -> Mapping[str, Any]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):   # a builtin without a signature: called as it is
        return {}


def _newest_checkpoint(cfg: Config, run_dir: Path) -> Path | None:
    from dagrl.runtime.checkpoint import latest_checkpoint

    return latest_checkpoint(Path(cfg.trainer.checkpoint_dir or run_dir / "checkpoints"))
