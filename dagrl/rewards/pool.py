"""Scorers in worker processes (`reward.num_workers`), each sample with a wall-clock limit
(`reward.timeout_s`).

pebble's ProcessPool runs one sample per task and, when a task runs past its timeout, kills the
worker process running it and starts a fresh one: a scorer that hangs (an endless loop, a
request that never returns) costs its sample `timeout_s` and nothing more. Workers are spawned
(not forked from the trainer, whose threads and accelerator state must not be copied) and
resolve the scorer themselves, from what can be pickled: the custom function's spec or a
scorer's registered name. A scorer may be an async function: each call then runs to completion
in its own event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import weakref
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessPool

from dagrl.rewards.custom import load_function
from dagrl.rewards.scorers import SCORERS

_custom_fns: dict[str, Any] = {}   # per worker process: custom_fn spec -> loaded function


def call_scorer(fn, *args) -> Any:
    """fn(*args), run to completion when it is a coroutine function."""
    result = fn(*args)
    if inspect.isawaitable(result):
        async def wait() -> Any:
            return await result

        result = asyncio.run(wait())
    return result


def _score_in_worker(custom_fn: str, scorer: str, data_source: str, response: str,
                     ground_truth: Any, extra_info: Any) -> Any:
    """One sample, in a worker: the same scorer the manager resolved in the trainer."""
    if custom_fn:
        if custom_fn not in _custom_fns:
            _custom_fns[custom_fn] = load_function(custom_fn)
        return call_scorer(_custom_fns[custom_fn], data_source, response, ground_truth,
                           extra_info)
    fn = SCORERS.get(scorer or data_source)
    return call_scorer(fn, response, ground_truth, extra_info)


class Timeout(Exception):
    """A sample's scorer ran past reward.timeout_s and was cut off."""


class ScorerPool:
    def __init__(self, num_workers: int, timeout_s: float, *, custom_fn: str = "",
                 scorer: str = "") -> None:
        self.timeout_s = timeout_s or None
        self.custom_fn, self.scorer = custom_fn, scorer
        self._pool = ProcessPool(max_workers=num_workers,
                                 context=multiprocessing.get_context("spawn"))
        # Stop the workers with the manager (and at interpreter exit).
        self._finalizer = weakref.finalize(self, _stop, self._pool)

    def score(self, responses: Sequence[str], data_sources: Sequence[str],
              ground_truths: Sequence, extra_infos: Sequence) -> list[Any]:
        """Each sample's raw scorer result, or the exception it raised (`Timeout` for a
        sample cut off), in order."""
        futures = [self._pool.schedule(_score_in_worker,
                                       args=(self.custom_fn, self.scorer, ds, resp, gt, info),
                                       timeout=self.timeout_s)
                   for resp, ds, gt, info in zip(responses, data_sources, ground_truths,
                                                 extra_infos, strict=True)]
        results: list[Any] = []
        for future in futures:
            try:
                results.append(future.result())
            except FutureTimeout:
                results.append(Timeout(f"no score within reward.timeout_s={self.timeout_s:g} s; "
                                       "the scorer was stopped"))
            except Exception as err:   # the scorer's own error, judged by the manager
                results.append(err)
        return results

    def close(self) -> None:
        self._finalizer()


def _stop(pool: ProcessPool) -> None:
    pool.stop()
    pool.join(timeout=10)
