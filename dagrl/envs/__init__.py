"""Environments for multi-turn rollouts: the interface and loader (base.py) and the built-in
example `guess_number` (guess_number.py)."""

from __future__ import annotations

from dagrl.envs import guess_number  # noqa: F401 (registers the built-in environment)
from dagrl.envs.base import ENVIRONMENTS, Environment, load_environment, step

__all__ = ["ENVIRONMENTS", "Environment", "load_environment", "step"]
