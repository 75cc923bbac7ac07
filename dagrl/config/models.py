"""The `models` section: more trained policies in the same graph, beside the main one.

The top-level sections (model, actor, rollout, ref, critic, reward, reward_model, judge,
algorithm) describe the main policy. Each entry of `models` names another one and overrides
those sections for it; what it leaves out it inherits from the top level:

    models:
      refiner:
        actor: {lr: 2.0e-3}
        rollout: {max_new_tokens: 6}

A graph node with `model: refiner` runs with the refiner's config and engines (its own
weights, optimizer, rollout engine and checkpoint) on the refiner's fields of the batch
(roles/multi_model.py); nodes without `model` use the main policy. Run-wide sections (data,
trainer, dag, logging, profiler) are shared and cannot be overridden per model.
"""

from __future__ import annotations

import re
from typing import Any

from dagrl.config.loader import ConfigError, from_dict, merge, to_dict

# `cfg` below is a dagrl.config.schema.Config; not imported here, since schema imports this.
Config = Any

# The sections an extra model may override.
MODEL_SECTIONS = ("model", "actor", "rollout", "ref", "critic", "reward", "reward_model",
                  "judge", "algorithm")
NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def derive_model_configs(cfg: Config) -> dict[str, Config]:
    """The full config of each extra model: the top level with `models.<name>` merged in.
    Errors name the key (`models.refiner.actor.lr ...`)."""
    out = {}
    base = {k: v for k, v in to_dict(cfg).items() if k != "models"}
    for name, overlay in cfg.models.items():
        where = f"models.{name}"
        if not NAME.match(name):
            raise ConfigError(f"{where}: a model name is lowercase letters, digits and _, "
                              "starting with a letter (it prefixes the model's batch fields "
                              "and metrics)")
        if not isinstance(overlay, dict):
            raise ConfigError(f"{where} must be a mapping of sections, got {overlay!r}")
        shared = sorted(set(overlay) - set(MODEL_SECTIONS))
        if shared:
            raise ConfigError(f"{where}: {shared} cannot be set per model (run-wide or unknown; "
                              f"a model may set {', '.join(MODEL_SECTIONS)})")
        derived = from_dict(type(cfg), merge(base, overlay), path=where)
        if derived.rollout.n != cfg.rollout.n:
            raise ConfigError(f"{where}.rollout.n must equal rollout.n ({cfg.rollout.n}): an "
                              "extra model answers each of the main policy's samples once, so "
                              "its groups are the main policy's groups")
        own, main = derived.actor, cfg.actor
        if (own.tensor_parallel_size, own.sequence_parallel_size) != (
                main.tensor_parallel_size, main.sequence_parallel_size):
            raise ConfigError(
                f"{where}.actor: tensor_parallel_size x sequence_parallel_size "
                f"({own.tensor_parallel_size} x {own.sequence_parallel_size}) must be the main "
                f"policy's ({main.tensor_parallel_size} x {main.sequence_parallel_size}): the "
                "policies' training nodes read the step's batch in one replicated layout")
        out[name] = derived
    return out


def model_config(cfg: Config, name: str) -> Config:
    """The config a node with `model: name` runs with ('' is the main policy)."""
    if not name:
        return cfg
    configs: dict[str, Any] = cfg.derived_models
    if name not in configs:
        raise ConfigError(f"no model {name!r} in models (models: {sorted(configs) or 'none'})")
    return configs[name]
