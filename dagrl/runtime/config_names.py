"""What a config names, checked when it is loaded — by `dagrl train` and by `dagrl.train(...)`
— so a typo fails in seconds, before transformers and the model code load: the data files and
model directories it lists (before torch too), and the names it looks up in registries above
the config layer (losses, estimators, scorers, tools, environments, rollout backends: their
modules import torch)."""

from __future__ import annotations

from dagrl.config.loader import ConfigError
from dagrl.config.model_source import check_model_sources
from dagrl.config.schema import Config
from dagrl.data.listed_files import check_listed_files


def check_config_names(cfg: Config) -> None:
    """The files, directories and registered names `cfg` refers to exist."""
    check_listed_files(cfg.data.train_files, cfg.data.val_files if cfg.validates else [])
    check_model_sources(cfg)
    check_registered_names(cfg)


def import_dag_modules(cfg: Config) -> None:
    """Import the user modules of dag.modules (docs/extending.md); the workers' planner imports
    them again, a no-op in this process. An import error is a ConfigError naming them."""
    if not cfg.dag.modules:
        return
    from dagrl.roles.registry import import_user_modules

    try:
        import_user_modules(cfg.dag.modules)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from err
    except Exception as err:   # anything the user's module raises while it is imported
        raise ConfigError(f"dag.modules={cfg.dag.modules}: importing them failed "
                          f"({type(err).__name__}: {err})") from err


def check_registered_names(cfg: Config) -> None:
    """Names the config looks up in a registry above the config layer, checked at load so a
    typo fails in a second, not after the model has loaded. The modules of dag.modules are
    imported first: the names they register (losses, estimators, scorers, ...) count."""
    from dagrl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
    from dagrl.algorithms.rollout_correction import rs_bounds, rs_options
    from dagrl.rewards.scorers import SCORERS

    import_dag_modules(cfg)
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
    check_rollout_backends(cfg)
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


def check_rollout_backends(cfg: Config) -> None:
    """rollout.backend (the main policy's and each extra one's) names a registered backend
    (a user's registers itself in a module of dag.modules, imported before this), and that
    backend's own checks pass (`RolloutBackend.check_config`)."""
    from dagrl.rollout import check_rollout_config

    check_rollout_config(cfg)
