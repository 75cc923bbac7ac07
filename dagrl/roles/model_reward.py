"""Rewards from models: the `reward_model` role (a sequence classifier's scalar per sample)
and the `judge` role (a generative model's parsed grade). With `reward.source=reward_model` or
`judge` the built-in graphs give their `reward` node one of these roles instead of the rule
scorers'; a graph file may name them directly.

Fields added for N samples, response width R: scores [N], token_level_scores [N, R] (as the
rule `reward` role), and rm_scores [N] (the reward model's raw output) or judge_parsed [N]
(1 where the judge's answer held a score).

A multi-turn episode is scored whole: the model reads the prompt and the entire response,
tool results included, as one assistant message (`score.episode_texts`, as verl does).
"""

from __future__ import annotations

import torch

from dagrl.data.batch import Batch
from dagrl.roles.registry import NodeContext, register_role
from dagrl.roles.score import episode_texts, place_outcome_scores


@register_role("reward_model", engines=("reward_model",), side="rollout")
def reward_model(ctx: NodeContext, batch: Batch) -> Batch:
    texts = episode_texts(ctx.engines.tokenizer, batch)
    scores = ctx.engines.reward_model.score(batch["prompt"], texts)
    batch["rm_scores"] = scores
    place_outcome_scores(ctx, batch, scores.clone())
    return batch


@register_role("judge", engines=("judge",), side="rollout")
def judge(ctx: NodeContext, batch: Batch) -> Batch:
    texts = episode_texts(ctx.engines.tokenizer, batch)
    result = ctx.engines.judge.grade(batch["prompt"], texts, batch["ground_truth"],
                                     batch["sample_seed"])
    parsed = torch.tensor(result.parsed, dtype=torch.float32)
    batch["judge_parsed"] = parsed
    place_outcome_scores(ctx, batch, torch.tensor(result.scores, dtype=torch.float32))
    ctx.metrics.add_sum("judge/unparseable", result.n_unparseable)
    ctx.metrics.add_mean("judge/parsed_fraction", float(parsed.sum()), len(batch))
    if result.first_unparseable:
        ctx.engines.log(f"judge: {result.n_unparseable} unparseable answer(s) scored "
                        f"{ctx.config.judge.unparseable_score}; first: {result.first_unparseable}")
    return batch
