"""Train: `dagrl train [CONFIG.yaml] [key=value ...]`, or `python -m dagrl.train ...`.

    dagrl train                                  # GRPO on the built-in arithmetic task
    dagrl train examples/grpo_arith.yaml actor.lr=1e-3 trainer.total_steps=100
    dagrl train --print-config rollout.n=4       # show the resolved config and exit
    dagrl train trainer.n_workers=2              # two workers, started as Ray actors
    torchrun --nproc-per-node 2 -m dagrl.train trainer.n_workers=2   # the same, without Ray
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from dagrl.config.loader import ConfigError, dump_yaml
from dagrl.config.presets import load_run_config
from dagrl.config.schema import Config


def split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """The optional leading YAML path, and the `key=value` overrides."""
    path = None
    rest = list(args)
    if rest and "=" not in rest[0]:
        path = rest.pop(0)
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise ConfigError(f"expected key=value overrides after the config file, got {bad}")
    return path, rest


def load_cli_config(args: Sequence[str]) -> Config:
    """[CONFIG.yaml] [key=value ...] -> the config, with algorithm.name's preset applied."""
    path, overrides = split_config_args(args)
    cfg = load_run_config(path, overrides)
    check_registered_names(cfg)
    return cfg


def check_registered_names(cfg: Config) -> None:
    """Names the config looks up in a registry above the config layer, checked at load so a
    typo fails in a second, not after the model has loaded."""
    from dagrl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
    from dagrl.algorithms.rollout_correction import rs_bounds, rs_options
    from dagrl.rewards.scorers import SCORERS

    if cfg.reward.scorer and cfg.reward.scorer not in SCORERS:
        raise ConfigError(f"reward.scorer: {SCORERS.unknown_message(cfg.reward.scorer)}")
    mt = cfg.rollout.multi_turn
    if mt.enable:   # a user's `file.py:name` is loaded (and checked) when the worker starts
        from dagrl.envs import ENVIRONMENTS
        from dagrl.tools import TOOLS

        for name in mt.tools:
            if ":" not in name and name not in TOOLS:
                raise ConfigError(f"rollout.multi_turn.tools: {TOOLS.unknown_message(name)}")
        env = mt.environment
        if env and ":" not in env and env not in ENVIRONMENTS:
            raise ConfigError(f"rollout.multi_turn.environment: "
                              f"{ENVIRONMENTS.unknown_message(env)}")
    algo = cfg.algorithm
    for key, registry in (("adv_estimator", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES),
                          ("kl_loss_type", KL_ESTIMATORS), ("kl_reward_type", KL_ESTIMATORS)):
        name = getattr(algo, key)
        if name not in registry:
            raise ConfigError(f"algorithm.{key}: {registry.unknown_message(name)}")
    rc = algo.rollout_correction
    if rc.rollout_rs:
        try:
            rs_bounds(rs_options(rc.rollout_rs), rc.rollout_rs_threshold)
        except ValueError as err:
            raise ConfigError(f"algorithm.rollout_correction.rollout_rs: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    ns = parser.parse_args(argv)
    try:
        cfg = load_cli_config(ns.args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    from dagrl.runtime.distributed import env_world
    from dagrl.runtime.launch import launch
    from dagrl.runtime.process import run_worker_from_env

    user_errors = _user_errors()
    if env_world() is not None:   # started by torchrun: this process is one worker
        run_worker_from_env(cfg)
        # Training is over and the process group is destroyed. Skip the interpreter's teardown:
        # some C++ thread left by torch's import machinery sometimes aborts the process there
        # ("terminate called without an active exception", ~1 run in 3 under pytest), which
        # torchrun reports as a failed run although every step and file was written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        try:
            launch(cfg)
        except user_errors as err:
            # Bad input or a failed run: the message names the cause; a traceback adds noise.
            print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from dagrl.data.dataset import DatasetError
    from dagrl.engines.models import TokenizerError
    from dagrl.extras import MissingExtraError
    from dagrl.rewards.manager import RewardError
    from dagrl.rollout.server import ServerError
    from dagrl.runtime.checkpoint import CheckpointError
    from dagrl.runtime.ray_launcher import WorkerFailed
    from dagrl.runtime.run_dir import RunDirError

    return (ConfigError, DatasetError, TokenizerError, RewardError, CheckpointError, RunDirError,
            WorkerFailed, MissingExtraError, ServerError, FileNotFoundError, FloatingPointError)


if __name__ == "__main__":
    sys.exit(main())
