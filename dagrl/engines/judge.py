"""A generative judge: a causal LM asked to grade each response, its grade parsed from the text.

For sample i the judge's prompt is `judge.template` rendered with the sample's question (the
last user message of its prompt), the policy's response (a multi-turn episode whole, tool
results included: roles/score.episode_texts) and the row's ground truth, wrapped in
the judge tokenizer's chat template. The judge generates through a rollout engine (greedy by
default) and the reward is

    r_i = float(first match of judge.score_pattern in the judge's answer) / judge.score_scale

An answer with no match (or a match that is not a finite number) is *unparseable*: it gets
`judge.unparseable_score`, is counted (metric judge/unparseable) and the first one is logged;
the run goes on, because a judge that sometimes rambles is normal, not a bug.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dagrl.config.model_rewards import JudgeConfig
from dagrl.data.dataset import encode_prompt
from dagrl.device import HOST
from dagrl.rollout.base import RolloutEngine
from dagrl.rollout.sampling import SamplingParams


def question_text(prompt: Any) -> str:
    """The question of a verl-layout prompt: a string, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else "\n".join(m["content"] for m in prompt)


@dataclass
class JudgeResult:
    scores: list[float]            # one per sample
    outputs: list[str]             # the judge's answers
    n_unparseable: int = 0
    first_unparseable: str | None = None
    parsed: list[bool] = field(default_factory=list)


class Judge:
    """Grades responses with `engine` (which holds the judge model) and the judge's tokenizer.
    `device`: where the engine takes its inputs (an in-process engine's model's device)."""

    def __init__(self, cfg: JudgeConfig, engine: RolloutEngine, tokenizer,
                 device: torch.device | str = HOST) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pattern = re.compile(cfg.score_pattern)

    def render(self, prompt: Any, response: str, ground_truth: Any) -> str:
        return self.cfg.template.format(prompt=question_text(prompt), response=response,
                                        ground_truth="" if ground_truth is None else ground_truth)

    def parse(self, answer: str) -> float | None:
        """The score in the judge's answer, or None when there is none."""
        match = self.pattern.search(answer)
        if match is None:
            return None
        try:
            value = float(match.group(1))
        except (TypeError, ValueError):
            return None
        return value / self.cfg.score_scale if math.isfinite(value) else None

    def generate(self, texts: Sequence[str], seeds: torch.Tensor) -> list[str]:
        """The judge's answer to each rendered prompt, in micro-batches (left-padded)."""
        answers = []
        mb = self.cfg.micro_batch_size
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(texts), mb):
            encoded = [encode_prompt(self.tokenizer, t) for t in texts[start:start + mb]]
            width = max(len(e) for e in encoded)
            ids = torch.full((len(encoded), width), pad, dtype=torch.long)
            mask = torch.zeros((len(encoded), width), dtype=torch.long)
            for i, e in enumerate(encoded):
                ids[i, width - len(e):] = torch.tensor(e)
                mask[i, width - len(e):] = 1
            # Rollout engines take their inputs on their model's device (the policy's come from
            # the batch, already there); the judge's prompts are tokenized here, on the host.
            out = self.engine.generate(ids.to(self.device), mask.to(self.device),
                                       seeds[start:start + mb].to(self.device),
                                       SamplingParams(temperature=self.cfg.temperature),
                                       max_new_tokens=self.cfg.max_new_tokens)
            rows = [r[m.bool()].tolist() for r, m in zip(out.responses.cpu(),
                                                          out.response_mask.cpu(), strict=True)]
            answers += self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        return answers

    def grade(self, prompts: Sequence[Any], responses: Sequence[str],
              ground_truths: Sequence[Any], seeds: torch.Tensor) -> JudgeResult:
        """Rewards of N responses; `seeds` [N] key the judge's sampling when temperature > 0."""
        texts = [self.render(p, r, g)
                 for p, r, g in zip(prompts, responses, ground_truths, strict=True)]
        answers = self.generate(texts, seeds)
        result = JudgeResult(scores=[], outputs=answers)
        for i, answer in enumerate(answers):
            score = self.parse(answer)
            result.parsed.append(score is not None)
            if score is None:
                result.n_unparseable += 1
                if result.first_unparseable is None:
                    result.first_unparseable = (f"sample {i}: no match of judge.score_pattern "
                                                f"{self.cfg.score_pattern!r} in {answer[:120]!r}")
                score = self.cfg.unparseable_score
            result.scores.append(score)
        return result
