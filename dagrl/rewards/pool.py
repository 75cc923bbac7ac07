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
import sys
import weakref
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pebble import ProcessExpired, ProcessPool

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
    """`reward.num_workers` scorer processes. A worker killed from outside (kill -9, the OOM
    killer) takes pebble's pool down with it: the samples it had not finished would never be
    scored (pebble marks the pool broken and leaves their futures pending). The pool is then
    started again and those samples scored again, up to RESTARTS times per call."""

    RESTARTS = 2
    POLL_S = 0.2   # how often a wait on the samples looks at the pool's health

    def __init__(self, num_workers: int, timeout_s: float, *, custom_fn: str = "",
                 scorer: str = "") -> None:
        self.num_workers = num_workers
        self.timeout_s = timeout_s or None
        self.custom_fn, self.scorer = custom_fn, scorer
        self.restarts = 0   # pools started again after a worker was killed (all calls)
        self._start()

    def _start(self) -> None:
        self._pool = ProcessPool(max_workers=self.num_workers,
                                 context=multiprocessing.get_context("spawn"))
        # Stop the workers with the manager (and at interpreter exit).
        self._finalizer = weakref.finalize(self, _stop, self._pool)

    def score(self, responses: Sequence[str], data_sources: Sequence[str],
              ground_truths: Sequence, extra_infos: Sequence) -> list[Any]:
        """Each sample's raw scorer result, or the exception it raised (`Timeout` for a
        sample cut off), in order."""
        tasks = [(self.custom_fn, self.scorer, ds, resp, gt, info)
                 for resp, ds, gt, info in zip(responses, data_sources, ground_truths,
                                               extra_infos, strict=True)]
        results: list[Any] = [None] * len(tasks)
        pending = list(range(len(tasks)))
        for attempt in range(self.RESTARTS + 1):
            pending = self._score_some(tasks, pending, results, last=attempt == self.RESTARTS)
            if not pending:
                return results
            self._finalizer()   # the broken pool's workers go
            self._start()
            self.restarts += 1
            print(f"[dagrl] reward pool: a worker died (killed from outside?); started the "
                  f"pool again to score its {len(pending)} unfinished sample(s)",
                  file=sys.stderr, flush=True)
        raise RuntimeError(f"the reward pool broke {self.RESTARTS + 1} times in one batch "
                           "(its workers keep dying: out of memory?)")

    def _score_some(self, tasks: list[tuple], indices: list[int], results: list[Any],
                    last: bool) -> list[int]:
        """Score tasks[i] for i in `indices` into results[i]; returns the indices the pool
        broke before finishing (a sample whose own worker died counts among them, but for
        the `last` attempt: then its ProcessExpired is its result)."""
        try:
            futures = {i: self._pool.schedule(_score_in_worker, args=tasks[i],
                                              timeout=self.timeout_s) for i in indices}
        except RuntimeError:   # pebble: "Unexpected error within the Pool" (already broken)
            return list(indices)
        waiting = set(futures.values())
        while waiting and self._pool.active:
            _, waiting = wait(waiting, timeout=self.POLL_S)
        lost = []
        for i, future in futures.items():
            if not future.done():
                lost.append(i)
                continue
            try:
                results[i] = future.result()
            except FutureTimeout:
                results[i] = Timeout(f"no score within reward.timeout_s={self.timeout_s:g} s; "
                                     "the scorer was stopped")
            except (ProcessExpired, BrokenProcessPool) as err:   # its worker died
                if last:
                    results[i] = err
                else:
                    lost.append(i)
            except Exception as err:   # the scorer's own error, judged by the manager
                results[i] = err
        return lost

    def close(self) -> None:
        self._finalizer()


def _stop(pool: ProcessPool) -> None:
    pool.stop()
    pool.join(timeout=10)
