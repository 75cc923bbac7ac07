"""Which server a request goes to (rollout.backend=server with several `rollout.server.urls`).

- **Sticky by context.** A request whose token context extends one already routed (the next
  turn of a multi-turn episode: the earlier context, the answer, the tool's output; or another
  sample of a GRPO group: the same prompt) goes to that request's server, whose prefix cache
  holds the shared prefix's keys and values. The longest such earlier context wins.
- **Least loaded** otherwise: the server with the fewest requests in flight (ties: the one
  least recently chosen).

`forget()` drops the remembered contexts: after a weight update the servers' prefix caches are
reset, so nothing is left to reuse.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

# Remembered contexts at most (then forgotten all at once): a frozen policy's servers never
# reset, and a run's later prompts rarely extend its early ones.
MAX_CONTEXTS = 1 << 16


class Router:
    """Thread-safe: the backend's request threads share one router."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = tuple(urls)
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._last_chosen = dict.fromkeys(self.urls, 0)
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        # context (as a tuple of token ids) -> the server it went to; and the lengths seen
        self._contexts: dict[tuple[int, ...], str] = {}
        self._lengths: set[int] = set()
        self.sticky_hits = 0     # requests routed to an earlier context's server

    @contextmanager
    def route(self, context: Sequence[int]) -> Iterator[str]:
        """The server for a request with this token context, counted in flight while the
        `with` block runs."""
        context = tuple(context)
        with self._lock:
            url = self._sticky(context)
            if url is None:
                url = min(self.urls, key=lambda u: (self._in_flight[u], self._last_chosen[u]))
            else:
                self.sticky_hits += 1
            if len(self._contexts) >= MAX_CONTEXTS:
                self._contexts.clear()
                self._lengths.clear()
            self._contexts[context] = url
            self._lengths.add(len(context))
            self._in_flight[url] += 1
            self._last_chosen[url] = next(self._clock)
        try:
            yield url
        finally:
            with self._lock:
                self._in_flight[url] -= 1

    def _sticky(self, context: tuple[int, ...]) -> str | None:
        """The server of the longest routed context that `context` starts with."""
        for length in sorted((n for n in self._lengths if n <= len(context)), reverse=True):
            url = self._contexts.get(context[:length])
            if url is not None:
                return url
        return None

    def forget(self) -> None:
        with self._lock:
            self._contexts.clear()
            self._lengths.clear()
