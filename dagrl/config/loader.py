"""Strict, typed loading of dataclass configs from YAML files and ``a.b=c`` overrides.

A config is a tree of plain dataclasses. :func:`load_config` layers the dataclass
defaults, an optional YAML file and command-line overrides, then :func:`from_dict`
builds the tree and checks every value against its annotation. Anything the loader
cannot make sense of -- an unknown key, a wrong type, a scalar where a section is
expected -- is a :class:`ConfigError` that names the full dotted key.

Convention for value checks: a config dataclass validates itself in
``__post_init__`` by raising ``ConfigError`` whose message *starts with the field
name* (``"clip_ratio_c must be > 1, got 0.5"``). When that dataclass is built as
the section at path ``actor``, the loader re-raises the error prefixed with the
path (``"actor.clip_ratio_c must be > 1, got 0.5"``), so sections never need to
know where they are mounted.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = [
    "ConfigError",
    "dump_yaml",
    "from_dict",
    "load_config",
    "merge",
    "parse_overrides",
    "with_defaults",
    "to_dict",
]

T = TypeVar("T")

# Scientific notation without a dot or without an exponent sign ("1e-4", "3E5",
# "1.0e4"): YAML 1.2 and every ML user read these as floats, but PyYAML follows
# YAML 1.1 and returns strings.
_SCI_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending dotted key."""


def require(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless `cond`: the check every section's `__post_init__`
    makes (its message starts with the field; the loader prefixes the section)."""
    if not cond:
        raise ConfigError(message)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also resolves ``1e-4``-style scalars to floats."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _SCI_FLOAT, list("-+.0123456789"))

# YAML 1.1 reads "_" inside a number as a digit separator: "0.5_2" would be the float 0.52 and
# "2_10" the int 210. dagrl's "L_U" bounds (algorithm.rollout_correction thresholds, verl's
# syntax) must stay the strings they are, so a number-like scalar with an underscore is a
# string (YAML 1.2 has no digit separator either). This resolver runs before the number ones.
_UNDERSCORED = re.compile(r"^[-+]?[0-9.][0-9.]*_[0-9._]*$")
for _first in "-+.0123456789":
    _Loader.yaml_implicit_resolvers[_first].insert(0, ("tag:yaml.org,2002:str", _UNDERSCORED))


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _describe(value: Any) -> str:
    """Short human form of a config value for error messages."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _type_error(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {_describe(value)}")


def _unknown_key_error(key: str, path: str, valid: list[str]) -> ConfigError:
    full = _join(path, key)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean '{_join(path, close[0])}'?"
    elif path:
        hint = f"valid keys in '{path}': {', '.join(valid)}"
    else:
        hint = f"valid top-level keys: {', '.join(valid)}"
    return ConfigError(f"unknown config key '{full}' ({hint})")


def _section_default(f: dataclasses.Field) -> Any:
    """The declared default of a field, or MISSING."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build dataclass ``cls`` from a nested mapping, checking every key and type.

    Missing keys take the dataclass defaults; a section given only in part keeps
    its declared default values for the keys it omits (so a section created by a
    customised ``default_factory`` is refined, not rebuilt). ``list`` and ``dict``
    values replace their defaults wholesale. Fields without a default are required.
    ``path`` is the dotted location of ``cls`` in the whole config, used in errors.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict expects a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        where = f"config section '{path}'" if path else "config"
        raise ConfigError(f"{where} must be a mapping, got {_describe(data)}")
    try:
        hints = typing.get_type_hints(cls)
    except NameError as err:
        raise TypeError(f"cannot resolve the annotations of {cls.__qualname__}: {err}") from err

    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if not isinstance(key, str) or key not in fields:
            raise _unknown_key_error(str(key), path, list(fields))

    kwargs: dict[str, Any] = {}
    missing: list[str] = []
    for name, f in fields.items():
        key = _join(path, name)
        if name in data:
            value = data[name]
            if isinstance(value, Mapping):
                default = _section_default(f)
                if dataclasses.is_dataclass(default) and not isinstance(default, type):
                    value = merge(to_dict(default), value)
            kwargs[name] = _convert(hints[name], value, key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(key)
    if missing:
        raise ConfigError(f"missing required config key(s): {', '.join(missing)}")

    try:
        return cls(**kwargs)
    except ConfigError as err:
        msg = str(err)
        if path and not msg.startswith(f"{path}."):
            raise ConfigError(f"{path}.{msg}") from err
        raise


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and return it in its typed form."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _convert_union(tp, value, key)
    if origin is Literal:
        args = typing.get_args(tp)
        # Compare types as well: True == 1, but a bool is not the literal 1.
        if any(value == a and type(value) is type(a) for a in args):
            return value
        allowed = ", ".join(repr(a) for a in args)
        raise ConfigError(f"config key '{key}' must be one of {allowed}, got {_describe(value)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config key '{key}' is a section and must be a mapping, got {_describe(value)}"
            )
        return from_dict(tp, value, path=key)
    base = origin or tp
    if base in (list, tuple):
        return _convert_sequence(tp, value, key)
    if base is dict:
        return _convert_mapping(tp, value, key)
    return _convert_scalar(tp, value, key)


def _convert_union(tp: Any, value: Any, key: str) -> Any:
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise _type_error(key, tp, value)
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        # Convert directly so a nested error keeps its precise message.
        return _convert(options[0], value, key)
    for option in options:
        try:
            return _convert(option, value, key)
        except ConfigError:
            continue
    raise _type_error(key, tp, value)


def _convert_sequence(tp: Any, value: Any, key: str) -> list | tuple:
    """list[X], tuple[X, ...] and fixed tuple[X, Y] annotations."""
    args = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
        raise _type_error(key, tp, value)
    if (typing.get_origin(tp) or tp) is list:
        item_tp = args[0] if args else Any
        return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        item_tp = args[0] if args else Any
        return tuple(_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"config key '{key}' must have {len(args)} items, got {len(value)}")
    return tuple(_convert(t, v, f"{key}[{i}]")
                 for i, (t, v) in enumerate(zip(args, value, strict=True)))


def _convert_mapping(tp: Any, value: Any, key: str) -> dict:
    args = typing.get_args(tp)
    if args and args[0] is not str:
        raise TypeError(f"config key '{key}': only dict[str, X] is supported, got {tp}")
    if not isinstance(value, Mapping):
        raise _type_error(key, tp, value)
    value_tp = args[1] if args else Any
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise ConfigError(f"config key '{key}' must have string keys, got {_describe(k)}")
        out[k] = _convert(value_tp, v, f"{key}.{k}")
    return out


def _convert_scalar(tp: Any, value: Any, key: str) -> Any:
    """bool, int, float (also from an int or a '1e-3' string) and str: no silent coercion."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and is_int:
        return value
    if tp is float:
        if isinstance(value, float):
            return value
        if is_int or (isinstance(value, str) and _SCI_FLOAT.match(value)):
            return float(value)
    if tp is str and isinstance(value, str):
        return value
    if tp in (bool, int, float, str):
        raise _type_error(key, tp, value)
    raise TypeError(f"config key '{key}' has an unsupported annotation: {tp!r}")


def to_dict(obj: Any) -> dict:
    """Turn a dataclass tree into plain dicts, lists and scalars (inverse of from_dict)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_dict expects a dataclass instance, got {obj!r}")
    return _plain(obj)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Only init fields: anything else would be an unknown key for from_dict.
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def parse_overrides(overrides: Sequence[str]) -> dict:
    """Turn ``["actor.lr=1e-4", "model.path=null"]`` into a nested dict.

    Values are read as YAML (``1e-4`` is a float, ``[a,b]`` a list, ``null`` None);
    an empty value is the empty string. A key given twice, or a key and a key inside it
    (``model={...}`` and ``model.path=...``), is refused: which one was meant is unknowable.
    """
    if isinstance(overrides, str):
        raise TypeError("parse_overrides expects a sequence of 'key=value' strings, not one str")
    out: dict[str, Any] = {}
    given: dict[str, str] = {}   # key -> the item that set it
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must have the form key=value")
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"override {item!r} has an empty part in key '{key}'")
        for other, earlier in given.items():
            if other == key or other.startswith(key + ".") or key.startswith(other + "."):
                raise ConfigError(f"given twice: {earlier}, {item}")
        given[key] = item
        try:
            value = _yaml_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {err}") from err
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return out


def render_value(value: Any) -> str:
    """A Python value as the text after `key=` that parse_overrides reads back as it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list | tuple | dict):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    text = str(value)
    return text if not text or _yaml_load(text) == value else json.dumps(text)


def with_defaults(defaults: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """A program's own `key=value` defaults (a benchmark's workload, say) under the user's
    overrides: a key the user gives replaces the default's; the user's own list still may not
    give a key twice (parse_overrides refuses it)."""
    given = [item.partition("=")[0].strip() for item in overrides]

    def replaced(item: str) -> bool:
        key = item.partition("=")[0].strip()
        return any(key == g or key.startswith(g + ".") or g.startswith(key + ".") for g in given)

    return [item for item in defaults if not replaced(item)] + list(overrides)


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict:
    """Recursively merge ``update`` into a copy of ``base``; ``update`` wins.

    Mappings are merged key by key; any other value (lists included) replaces.
    Neither input is modified.
    """
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(out.get(key), Mapping) and isinstance(value, Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_yaml_file(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file '{path}': {err}") from err
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file '{path}' is not valid YAML: {err}") from err
    if data is None:  # an empty file (or only comments) means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' must contain a mapping at the top level, got {_describe(data)}"
        )
    return data


def load_user_dict(path: str | Path | Mapping[str, Any] | None = None,
                   overrides: Sequence[str] = ()) -> dict:
    """What the user set: the YAML file at ``path`` (or a nested dict given in its place, as
    `dagrl.train` takes one) updated by ``overrides``."""
    if isinstance(path, Mapping):
        data = copy.deepcopy(dict(path))
    else:
        data = _read_yaml_file(Path(path)) if path is not None else {}
    return merge(data, parse_overrides(overrides))


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> T:
    """Build ``cls`` from its defaults, then the YAML file at ``path``, then ``overrides``."""
    return from_dict(cls, load_user_dict(path, overrides))


def dump_yaml(obj: Any) -> str:
    """Render a dataclass tree as YAML in declaration order; load_config reads it back."""
    return yaml.safe_dump(
        to_dict(obj), sort_keys=False, default_flow_style=False, allow_unicode=True
    )
