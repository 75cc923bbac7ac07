"""The rollout backends by name: `rollout.backend` is looked up in `ROLLOUT_BACKENDS`.

Each backend is one class (a `RolloutBackend`, base.py) registered with one decorator call in
its own module; it declares its capabilities and its refusals, and builds its engine:

    @ROLLOUT_BACKENDS.register("mine")
    class MyRollout(RolloutBackend):
        trainer_numerics = False
        @classmethod
        def from_config(cls, cfg, build): ...

The config layer cannot see this registry (config/ sits below rollout/), so it takes
`rollout.backend` as any string; the name and the backend's own checks are run here, by
`rollout_backend`, which the load-time check (`runtime/config_names.check_registered_names`), the
planner (`roles/plan.py`) and `build_rollout` all call: a bad name or a refused combination is
an error naming the key before any model loads.
"""

from __future__ import annotations

from dagrl.config.loader import ConfigError
from dagrl.config.schema import Config
from dagrl.registry import Registry
from dagrl.rollout.base import RolloutBackend

ROLLOUT_BACKENDS: Registry[type[RolloutBackend]] = Registry("rollout backend")


def rollout_backend(cfg: Config) -> type[RolloutBackend]:
    """The backend class `cfg.rollout.backend` names, after its `check_config(cfg)`: read its
    capabilities (`rollout_backend(cfg).joins_process_group`) or build with it. An unknown name
    is a `ConfigError` naming the key and the closest registered name."""
    name = cfg.rollout.backend
    if name not in ROLLOUT_BACKENDS:
        raise ConfigError(f"rollout.backend: {ROLLOUT_BACKENDS.unknown_message(name)}")
    backend = ROLLOUT_BACKENDS.get(name)
    backend.check_config(cfg)
    return backend


def check_rollout_config(cfg: Config) -> None:
    """`rollout_backend` for the config and for each extra policy's (`models.<name>`), whose
    errors are prefixed with the model's key."""
    rollout_backend(cfg)
    for name, derived in cfg.derived_models.items():
        try:
            rollout_backend(derived)
        except ConfigError as err:
            raise ConfigError(f"models.{name}: {err}") from None
