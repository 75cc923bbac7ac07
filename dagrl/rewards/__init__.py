"""Rewards: rule scorers keyed by data_source, user reward functions, and the manager."""

from __future__ import annotations

from dagrl.rewards.custom import load_function
from dagrl.rewards.manager import RewardError, RewardManager, RewardResult
from dagrl.rewards.scorers import (
    SCORERS,
    arith_score,
    gsm8k_score,
    last_boxed,
    math_score,
    normalize_math_answer,
)

__all__ = [
    "SCORERS",
    "RewardError",
    "RewardManager",
    "RewardResult",
    "arith_score",
    "gsm8k_score",
    "last_boxed",
    "load_function",
    "math_score",
    "normalize_math_answer",
]
