"""Load a user reward function from ``"path/to/file.py:name"`` or ``"package.module:name"``
(the same loader brings in a user's tools and environments, dagrl/tools and dagrl/envs).

User functions follow verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

so reward files written for verl work unchanged.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

# Callables handed over in this process (the Python API's reward_fn defined in a notebook or in
# a script's __main__, which no other process can import): spec "in-process:<name>".
IN_PROCESS_PREFIX = "in-process:"
_in_process: dict[str, Callable] = {}


def in_process_spec(fn: Callable) -> str:
    """A spec that `load_function` resolves to `fn`, in this process only."""
    name = f"{getattr(fn, '__qualname__', type(fn).__name__)}@{id(fn):x}"
    _in_process[name] = fn
    return IN_PROCESS_PREFIX + name


def _is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_file(spec: str, target: str, what: str, isolated: bool = False) -> ModuleType:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{what} {spec!r}: file {str(path)!r} does not exist")
    # A name unique per absolute path: two different reward.py files must not share a module.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"dagrl_user_reward_{path.stem}_{digest}" + ("_isolated" if isolated else "")
    if module_name in sys.modules and not isolated:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"{what} {spec!r}: cannot import {str(path)!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so dataclasses / pickling inside the user file can find it.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    if isolated:   # a copy of its own: what it is called with leaves the shared one untouched
        del sys.modules[module_name]
    return module


def load_function(spec: str, what: str = "reward function", isolated: bool = False) -> Callable:
    """Import and return the callable named by ``spec``.

    ``spec`` is ``"file.py:function"`` (path absolute or relative to the current directory)
    or ``"package.module:function"``; ``what`` names it in the errors ("tool", ...).
    ``isolated``: a file is imported afresh into a module of its own, so calls to the function
    returned (the pre-flight's probe) leave the state of the one training calls untouched.
    """
    if spec.startswith(IN_PROCESS_PREFIX):
        fn = _in_process.get(spec[len(IN_PROCESS_PREFIX):])
        if fn is None:
            raise ValueError(f"{what} {spec!r} was handed to dagrl.train in another process; "
                             "it runs only there (one worker, reward.num_workers=0)")
        return fn
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(
            f"{what} spec {spec!r} must look like 'path/to/file.py:function_name' "
            "or 'package.module:function_name'"
        )
    if _is_file_spec(target):
        module = _load_file(spec, target, what, isolated)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"{what} {spec!r}: module {target!r} not found ({exc})"
            ) from exc
    if not hasattr(module, name):
        available = sorted(
            attr for attr, value in vars(module).items()
            if callable(value) and not attr.startswith("_")
        )
        raise AttributeError(
            f"{what} {spec!r}: {target!r} has no attribute {name!r}. "
            f"Callables there: {', '.join(available) or '(none)'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(
            f"{what} {spec!r}: {name!r} is a {type(fn).__name__}, not a callable"
        )
    return fn
