"""Turn decoded responses into one scalar reward per sample.

Each sample is scored by the user function ``reward.custom_fn`` when one is set, otherwise by
the rule scorer registered for its ``data_source``. A scorer that raises or returns something
other than a finite number is a *failure*: by default it stops the run with a message naming
the sample; with ``on_error="count"`` the sample gets ``error_score`` and the failure is counted
so the caller can report it as a metric. Failures are never silently turned into zeros.

Scorers may be async functions. With ``num_workers > 0`` they run in a pool of processes
(pool.py), side by side, and with ``timeout_s > 0`` a sample whose scorer runs longer is cut
off: it gets ``error_score`` and is counted as a timeout whatever ``on_error`` says, so one
hanging scorer never stalls the step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dagrl.registry import UnknownNameError
from dagrl.rewards.custom import load_function
from dagrl.rewards.pool import ScorerPool, Timeout, call_scorer
from dagrl.rewards.scorers import SCORERS

ON_ERROR_CHOICES = ("raise", "count")


class RewardError(RuntimeError):
    """A scorer failed on a sample; the message names the sample, data_source and scorer."""


@dataclass
class RewardResult:
    scores: list[float]  # one per sample
    n_errors: int = 0  # failures replaced by error_score under on_error="count"
    n_timeouts: int = 0  # samples cut off at timeout_s (given error_score)
    first_error: str | None = None  # message of the first failure, for the log
    # extra numeric keys from dict-returning scorers; NaN where a sample lacks the key
    extra: dict[str, list[float]] = field(default_factory=dict)


def _is_number(value: Any) -> bool:
    # bool is an Integral, but a scorer returning True almost always means a forgotten float()
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def unpack_score(result: Any) -> tuple[float, dict[str, float]]:
    """Split a scorer's return value into (score, extra metrics); raise on anything malformed."""
    extra: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without a 'score' key (keys: {sorted(result)})")
        # Only numeric side values are metrics; strings such as a parsed prediction are dropped.
        extra = {
            str(k): float(v)
            for k, v in result.items()
            if k != "score" and isinstance(v, (numbers.Real, np.bool_))
        }
        result = result["score"]
    if not _is_number(result):
        raise TypeError(f"returned {type(result).__name__} {result!r}, expected a finite number")
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"returned non-finite score {score}")
    return score, extra


def _call_or_error(fn: Callable, *args) -> Any:
    """A scorer's raw result in this process, or the exception it raised."""
    try:
        return call_scorer(fn, *args)
    except Exception as exc:
        return exc


def _scorer_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class RewardManager:
    """Scores batches of decoded responses.

    Args:
        on_error: ``"raise"`` stops at the first failing sample with a :class:`RewardError`;
            ``"count"`` gives failing samples ``error_score`` and counts them.
        custom_fn: ``"file.py:fn"`` or ``"module:fn"`` with verl's signature
            ``fn(data_source, solution_str, ground_truth, extra_info=None)``; when set it
            scores every sample, whatever its data_source.
        error_score: reward of a failed sample under ``on_error="count"``.
        scorer: a registered scorer name that scores every sample, whatever its data_source.
        num_workers: processes that run the scorers; 0 scores in this process.
        timeout_s: with num_workers > 0, the most seconds one sample's scorer may take.
    """

    def __init__(self, *, on_error: str = "raise", custom_fn: str = "", error_score: float = 0.0,
                 scorer: str = "", num_workers: int = 0, timeout_s: float = 0.0):
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(
                f"reward.on_error must be one of {', '.join(map(repr, ON_ERROR_CHOICES))}, "
                f"got {on_error!r}"
            )
        if not _is_number(error_score) or not math.isfinite(float(error_score)):
            raise ValueError(f"reward.error_score must be a finite number, got {error_score!r}")
        self.on_error = on_error
        self.error_score = float(error_score)
        self.custom_fn_spec = custom_fn
        # Loaded here so a bad spec fails at start-up, not after the first rollout.
        self.custom_fn = load_function(custom_fn) if custom_fn else None
        self.scorer = SCORERS.get(scorer) if scorer else None
        if timeout_s and not num_workers:
            raise ValueError("reward.timeout_s needs reward.num_workers > 0: a scorer running "
                             "in the trainer's own process cannot be cut off")
        self.pool = (ScorerPool(num_workers, timeout_s, custom_fn=custom_fn, scorer=scorer)
                     if num_workers else None)

    def _resolve(self, data_source: str, index: int) -> tuple[Callable[..., Any], str]:
        """(fn(solution_str, ground_truth, extra_info), name) for one sample's data_source."""
        if self.custom_fn is not None:
            custom = self.custom_fn
            return (
                lambda resp, gt, info: custom(data_source, resp, gt, info),
                f"custom_fn {self.custom_fn_spec!r}",
            )
        if self.scorer is not None:
            return self.scorer, _scorer_name(self.scorer)
        if data_source not in SCORERS:
            # A configuration error rather than a sample failure, so it is raised under
            # on_error="count" too.
            raise UnknownNameError(
                f"no reward scorer for data_source {data_source!r} (sample {index}): "
                f"{SCORERS.unknown_message(data_source)}. Set reward.custom_fn="
                "'file.py:compute_score' to score other data sources."
            )
        fn = SCORERS.get(data_source)
        return fn, _scorer_name(fn)

    def score(
        self,
        responses: Sequence[str],
        data_sources: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence[dict | None],
        sample_ids: Sequence[str] | None = None,
    ) -> RewardResult:
        """Score ``responses[i]`` against ``ground_truths[i]`` for every sample i."""
        n = len(responses)
        lengths = {
            "data_sources": len(data_sources),
            "ground_truths": len(ground_truths),
            "extra_infos": len(extra_infos),
        }
        if sample_ids is not None:
            lengths["sample_ids"] = len(sample_ids)
        mismatched = {k: v for k, v in lengths.items() if v != n}
        if mismatched:
            raise ValueError(f"reward inputs disagree in length: responses has {n}, {mismatched}")

        # Resolve every scorer first: an unknown data_source fails before any work is done.
        scorers = [self._resolve(ds, i) for i, ds in enumerate(data_sources)]

        if self.pool is not None:
            raw = self.pool.score(responses, data_sources, ground_truths, extra_infos)
        else:
            raw = [_call_or_error(fn, response, ground_truths[i], extra_infos[i])
                   for i, ((fn, _), response) in enumerate(zip(scorers, responses, strict=True))]
        result = RewardResult(scores=[])
        extras: list[dict[str, float]] = []
        for i, ((_, name), response) in enumerate(zip(scorers, responses, strict=True)):
            if isinstance(raw[i], Timeout):
                result.n_timeouts += 1
                result.first_error = result.first_error or (
                    f"reward timed out for sample {i}"
                    + (f" (id {sample_ids[i]!r})" if sample_ids is not None else "")
                    + f", scorer {name}: {raw[i]}")
                result.scores.append(self.error_score)
                extras.append({})
                continue
            try:
                if isinstance(raw[i], Exception):
                    raise raw[i]
                score, extra = unpack_score(raw[i])
            except Exception as exc:
                sample = f"sample {i}"
                if sample_ids is not None:
                    sample += f" (id {sample_ids[i]!r})"
                message = (
                    f"reward failed for {sample}, data_source {data_sources[i]!r}, scorer "
                    f"{name}: {type(exc).__name__}: {exc}; response[:80]={response[:80]!r}"
                )
                if self.on_error == "raise":
                    raise RewardError(message) from exc
                result.n_errors += 1
                result.first_error = result.first_error or message
                score, extra = self.error_score, {}
            result.scores.append(score)
            extras.append(extra)

        keys = sorted({k for extra in extras for k in extra})
        result.extra = {k: [extra.get(k, math.nan) for extra in extras] for k in keys}
        return result
