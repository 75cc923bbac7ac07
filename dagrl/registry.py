"""A name -> object registry, shared by every pluggable part of dagrl.

Advantage estimators, policy losses, KL estimators, loss aggregation modes, reward scorers and
DAG node roles are all looked up by name from a config string. One small class keeps the
lookup errors uniform: an unknown name names the kind, the closest valid name and all valid names.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised for a name that is not registered. ``str(err)`` is the full message."""

    def __str__(self) -> str:  # KeyError would repr() the message; show it plainly
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names (and aliases) to objects of one kind.

    >>> LOSSES = Registry("policy loss")
    >>> @LOSSES.register("vanilla", "ppo")
    ... def vanilla(...): ...
    >>> LOSSES.get("ppo") is vanilla
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        if not names:
            raise ValueError(f"register() for a {self.kind} needs at least one name")

        def decorator(obj: T) -> T:
            for name in names:
                self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self._items, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}.{hint} Known: {', '.join(sorted(self._items))}"

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
