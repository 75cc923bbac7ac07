"""`guess_number`: the built-in example environment. The policy guesses a secret integer and is
told `higher` or `lower` until it finds it: a reward of 1 for the right guess, -0.1 for each
wrong one (a per-turn reward, credited to that turn's last token), the episode over at the
right guess or when the turns run out. Rows: `dagrl data make guess-number` (the secret is the
ground truth; extra_info holds the range)."""

from __future__ import annotations

import re

from dagrl.envs.base import ENVIRONMENTS

WRONG_GUESS_REWARD = -0.1
_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    def __init__(self) -> None:
        self.secret: int | None = None

    def reset(self, row: dict) -> list[dict]:
        self.secret = int(row["ground_truth"])
        info = row.get("extra_info") or {}
        low, high = info.get("low", 1), info.get("high", 100)
        prompt = row.get("prompt")
        if prompt:
            return [dict(m) for m in prompt]
        return [{"role": "user", "content": f"guess a number from {low} to {high}: "}]

    def step(self, text: str) -> tuple[str, float, bool]:
        numbers = _NUMBER.findall(text)
        if not numbers:
            return "say a number. ", WRONG_GUESS_REWARD, False
        guess = int(numbers[-1])
        if guess == self.secret:
            return "correct", 1.0, True
        return ("higher. " if guess < self.secret else "lower. "), WRONG_GUESS_REWARD, False


ENVIRONMENTS.add("guess_number", GuessNumber)
