"""Tests for dagrl.config.loader: strict typed loading of dataclass configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from dagrl.config.loader import (
    ConfigError,
    dump_yaml,
    from_dict,
    load_config,
    merge,
    parse_overrides,
    to_dict,
)


@dataclass
class OptimCfg:
    lr: float = 1e-6
    betas: tuple[float, ...] = (0.9, 0.999)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")


@dataclass
class ActorCfg:
    clip_ratio_c: float = 3.0
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    max_tokens: int | None = None
    use_kl: bool = False
    optim: OptimCfg = field(default_factory=OptimCfg)

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1:
            raise ConfigError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")


@dataclass
class LoggingCfg:
    backends: list[str] = field(default_factory=lambda: ["console"])
    reward_weights: dict[str, float] = field(default_factory=dict)
    project: str | None = "dagrl"


@dataclass
class TrainCfg:
    seed: int = 0
    actor: ActorCfg = field(default_factory=ActorCfg)
    # A section whose default differs from ActorCfg's own defaults.
    critic: ActorCfg = field(default_factory=lambda: ActorCfg(clip_ratio_c=5.0, use_kl=True))
    logging: LoggingCfg = field(default_factory=LoggingCfg)


@dataclass
class DeviceCfg:
    device: int | Literal["auto"] = "auto"
    image_size: tuple[int, int] = (224, 224)


@dataclass
class NeedsPath:
    model_path: str
    seed: int = 0


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# --- building and defaults -------------------------------------------------


def test_defaults_when_nothing_given():
    cfg = load_config(TrainCfg)
    assert cfg == TrainCfg()
    assert cfg.logging.backends == ["console"]
    assert cfg.critic.clip_ratio_c == 5.0


def test_partial_section_keeps_factory_defaults():
    cfg = load_config(TrainCfg, overrides=["critic.loss_agg=seq-mean"])
    assert cfg.critic == ActorCfg(clip_ratio_c=5.0, use_kl=True, loss_agg="seq-mean")


def test_yaml_file_and_overrides(tmp_path):
    path = write(
        tmp_path,
        """
seed: 3
actor:
  clip_ratio_c: 2
  loss_agg: seq-mean
  optim:
    lr: 1e-5
    betas: [0.8, 0.9]
logging:
  reward_weights: {acc: 1, fmt: 0.5}
""",
    )
    cfg = load_config(TrainCfg, path, overrides=["seed=7", "actor.optim.lr=2e-6"])
    assert cfg.seed == 7
    assert cfg.actor.clip_ratio_c == 2.0 and isinstance(cfg.actor.clip_ratio_c, float)
    assert cfg.actor.loss_agg == "seq-mean"
    assert cfg.actor.optim.lr == 2e-6
    assert cfg.actor.optim.betas == (0.8, 0.9)
    assert cfg.logging.reward_weights == {"acc": 1.0, "fmt": 0.5}
    assert cfg.logging.backends == ["console"]


def test_overrides_values():
    cfg = load_config(
        TrainCfg,
        overrides=[
            "actor.optim.lr=3E-4",
            "actor.max_tokens=512",
            "actor.use_kl=true",
            "logging.backends=[console,jsonl]",
            "logging.project=null",
            "logging.reward_weights.acc=1e0",
        ],
    )
    assert cfg.actor.optim.lr == 3e-4
    assert cfg.actor.max_tokens == 512
    assert cfg.actor.use_kl is True
    assert cfg.logging.backends == ["console", "jsonl"]
    assert cfg.logging.project is None
    assert cfg.logging.reward_weights == {"acc": 1.0}


def test_empty_yaml_file_means_defaults(tmp_path):
    assert load_config(TrainCfg, write(tmp_path, "# nothing here\n")) == TrainCfg()


def test_scientific_string_accepted_for_float_only():
    # A dict produced by plain yaml.safe_load carries "1e-4" as a string.
    cfg = from_dict(TrainCfg, yaml.safe_load("actor: {optim: {lr: 1e-4}}"))
    assert cfg.actor.optim.lr == 1e-4
    with pytest.raises(ConfigError, match=r"'actor.optim.lr' must be float, got str 'abc'"):
        from_dict(TrainCfg, {"actor": {"optim": {"lr": "abc"}}})
    with pytest.raises(ConfigError, match=r"'logging.project' must be str, got float 100000.0"):
        load_config(TrainCfg, overrides=["logging.project=1e5"])


# --- parse_overrides and merge ---------------------------------------------


def test_parse_overrides():
    out = parse_overrides(
        ["actor.lr=1e-4", "rollout.n=16", "a.b.c=x", "empty=", "model.path=null"]
    )
    assert out == {
        "actor": {"lr": 1e-4},
        "rollout": {"n": 16},
        "a": {"b": {"c": "x"}},
        "empty": "",
        "model": {"path": None},
    }
    assert isinstance(out["actor"]["lr"], float)
    with pytest.raises(ConfigError, match="given twice: rollout.n=8, rollout.n=16"):
        parse_overrides(["rollout.n=8", "actor.lr=1", "rollout.n=16"])
    assert parse_overrides(["x=[1e-3, 2]", "y=-2.5e+3", "z=1.0e4"]) == {
        "x": [1e-3, 2],
        "y": -2500.0,
        "z": 10000.0,
    }


@pytest.mark.parametrize("item", ["actor.lr", "=3", "actor..lr=1"])
def test_parse_overrides_rejects_malformed(item):
    with pytest.raises(ConfigError, match=repr(item).replace(".", r"\.").replace("[", r"\[")):
        parse_overrides([item])


def test_merge_is_recursive_and_pure():
    base = {"a": {"x": 1, "y": [1]}, "b": 2}
    update = {"a": {"y": [2]}, "c": 3}
    out = merge(base, update)
    assert out == {"a": {"x": 1, "y": [2]}, "b": 2, "c": 3}
    out["a"]["x"] = 99
    assert base == {"a": {"x": 1, "y": [1]}, "b": 2}


# --- errors ------------------------------------------------------------------


_ERRORS = [
    (
        "actor.clip_ratio_cc=2",
        r"unknown config key 'actor.clip_ratio_cc' \(did you mean 'actor.clip_ratio_c'\?\)",
    ),
    ("actr.use_kl=true", r"unknown config key 'actr' \(did you mean 'actor'\?\)"),
    (
        "zzz.q=1",
        r"unknown config key 'zzz' \(valid top-level keys: seed, actor, critic, logging\)",
    ),
    (
        "actor.optim.qq=1",
        r"unknown config key 'actor.optim.qq' \(valid keys in 'actor.optim': lr, betas\)",
    ),
    ("seed=abc", r"config key 'seed' must be int, got str 'abc'"),
    ("seed=true", r"config key 'seed' must be int, got bool True"),
    ("seed=1.5", r"config key 'seed' must be int, got float 1.5"),
    ("actor.use_kl=1", r"config key 'actor.use_kl' must be bool, got int 1"),
    ("actor.use_kl=yes_please", r"config key 'actor.use_kl' must be bool, got str"),
    ("actor.optim.lr=true", r"config key 'actor.optim.lr' must be float, got bool True"),
    (
        "actor.loss_agg=mean",
        r"config key 'actor.loss_agg' must be one of 'token-mean', 'seq-mean', got str 'mean'",
    ),
    ("actor.max_tokens=many", r"config key 'actor.max_tokens' must be int, got str 'many'"),
    ("logging.backends=console", r"config key 'logging.backends' must be list\[str\], got str"),
    ("logging.backends=[console,3]", r"config key 'logging.backends\[1\]' must be str, got int 3"),
    ("logging.reward_weights.acc=high", r"config key 'logging.reward_weights.acc' must be float"),
    ("actor=3", r"config key 'actor' is a section and must be a mapping, got int 3"),
    ("actor=null", r"config key 'actor' is a section and must be a mapping, got null"),
    ("seed.x=1", r"config key 'seed' must be int, got a mapping"),
    ("actor.clip_ratio_c=0.5", r"^actor\.clip_ratio_c must be > 1, got 0.5$"),
    ("critic.optim.lr=-1", r"^critic\.optim\.lr must be > 0, got -1.0$"),
]


@pytest.mark.parametrize(("override", "message"), _ERRORS)
def test_errors_name_the_dotted_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainCfg, overrides=[override])


def test_same_errors_from_yaml_file(tmp_path):
    suggestion = r"unknown config key 'actor.use_kll' \(did you mean 'actor.use_kl'\?\)"
    with pytest.raises(ConfigError, match=suggestion):
        load_config(TrainCfg, write(tmp_path, "actor:\n  use_kll: true\n"))
    with pytest.raises(ConfigError, match=r"^actor\.clip_ratio_c must be > 1"):
        load_config(TrainCfg, write(tmp_path, "actor:\n  clip_ratio_c: 1\n"))


def test_union_and_fixed_tuple():
    cfg = load_config(DeviceCfg, overrides=["device=2", "image_size=[32, 64]"])
    assert cfg == DeviceCfg(device=2, image_size=(32, 64))
    assert load_config(DeviceCfg).device == "auto"
    union_error = r"'device' must be int \| Literal\['auto'\], got str 'cpu'"
    with pytest.raises(ConfigError, match=union_error):
        load_config(DeviceCfg, overrides=["device=cpu"])
    with pytest.raises(ConfigError, match=r"'image_size' must have 2 items, got 3"):
        load_config(DeviceCfg, overrides=["image_size=[1, 2, 3]"])
    with pytest.raises(ConfigError, match=r"'image_size\[1\]' must be int, got str 'x'"):
        load_config(DeviceCfg, overrides=["image_size=[1, x]"])


def test_missing_required_key():
    with pytest.raises(ConfigError, match=r"missing required config key\(s\): model_path"):
        load_config(NeedsPath)
    assert load_config(NeedsPath, overrides=["model_path=/m"]).model_path == "/m"


def test_bad_yaml_file(tmp_path):
    path = write(tmp_path, "actor: [unclosed\n")
    with pytest.raises(ConfigError, match=f"config file '{path}' is not valid YAML"):
        load_config(TrainCfg, path)


def test_yaml_file_not_a_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match=f"config file '{path}' must contain a mapping.*got list"):
        load_config(TrainCfg, path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file '{path}' not found"):
        load_config(TrainCfg, path)


def test_from_dict_root_must_be_mapping():
    with pytest.raises(ConfigError, match=r"config must be a mapping, got list"):
        from_dict(TrainCfg, [1, 2])  # type: ignore[arg-type]


# --- round trips ---------------------------------------------------------------


def make_custom() -> TrainCfg:
    return load_config(
        TrainCfg,
        overrides=[
            "seed=5",
            "actor.optim.lr=1e-10",
            "actor.optim.betas=[0.5, 0.75]",
            "actor.max_tokens=64",
            "logging.backends=[jsonl]",
            "logging.reward_weights={a: 0.25}",
            "logging.project='123'",
        ],
    )


def test_to_dict_from_dict_round_trip():
    cfg = make_custom()
    plain = to_dict(cfg)
    assert plain["actor"]["optim"] == {"lr": 1e-10, "betas": [0.5, 0.75]}
    assert plain["logging"]["project"] == "123"
    assert from_dict(TrainCfg, plain) == cfg


def test_dump_yaml_readable_and_reloadable(tmp_path):
    cfg = make_custom()
    text = dump_yaml(cfg)
    top_keys = [line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")]
    assert top_keys == ["seed", "actor", "critic", "logging"]  # declaration order
    assert "  clip_ratio_c: 3.0\n" in text  # block style, one key per line
    assert load_config(TrainCfg, write(tmp_path, text)) == cfg
