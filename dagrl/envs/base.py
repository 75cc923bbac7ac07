"""Environments: interactive tasks a policy acts in over several turns.

An environment answers each policy turn that calls no tool:

    class MyEnv:
        def reset(self, row: dict) -> list[dict]:
            # row: the dataset row's prompt (a message list), data_source, ground_truth and
            # extra_info; returns the opening messages of the chat
        def step(self, text: str) -> tuple[str, float, bool]:
            # the policy's turn -> (observation, reward, done); the observation comes back
            # to the policy as a user message, the reward is credited to the turn's last token

`step` may be a coroutine function. One instance plays one episode (a fresh one per sample).
`rollout.multi_turn.environment` names a built-in (ENVIRONMENTS) or a user's class by
`path/to/file.py:Class` / `package.module:Class`. An episode's rewards are its score: the reward
manager does not score environment episodes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from dagrl.registry import Registry
from dagrl.rewards.custom import load_function


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> list[dict]:
        """The opening messages for a dataset row."""

    def step(self, text: str) -> tuple[str, float, bool]:
        """(observation, reward, done) after the policy's turn `text`."""


ENVIRONMENTS: Registry[Callable[[], Environment]] = Registry("environment")


def load_environment(spec: str) -> Callable[[], Environment]:
    """A factory of fresh environments: a built-in by name, or a user's class by `file.py:Class`
    / `module:Class`."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS.get(spec)
    if ":" not in spec:
        raise ValueError(f"rollout.multi_turn.environment: {ENVIRONMENTS.unknown_message(spec)} "
                         "(or name your own as path/to/file.py:Class)")
    factory = load_function(spec, what="environment")
    sample = factory()
    missing = [m for m in ("reset", "step") if not callable(getattr(sample, m, None))]
    if missing:
        raise TypeError(f"environment {spec!r}: {type(sample).__name__} has no "
                        f"{' or '.join(missing)} method (see dagrl/envs/base.py)")
    return factory


async def step(env: Environment, text: str) -> tuple[str, float, bool]:
    """`env.step(text)`, awaited when it is a coroutine function, checked."""
    result = env.step(text)
    if inspect.isawaitable(result):
        result = await result
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"{type(env).__name__}.step must return (observation, reward, done), "
                        f"got {result!r}")
    observation, reward, done = result
    return str(observation), float(reward), bool(done)
