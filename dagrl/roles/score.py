"""The `reward` role: score each response with the reward manager (rule scorers, user
functions), add DAPO's overlong shaping when configured, and place the outcome reward on the
last response token: the policy's last token, as a multi-turn response ends with its
final turn. (Model-based rewards: roles/model_reward.py, ending in the same
`place_outcome_scores`.)

Multi-turn rollouts: the reward manager scores the whole response, tool and environment
messages included (`response_attention_mask`, as verl decodes multi-turn responses);
an environment's episodes are scored by the environment (the rule scorers are not asked), its
per-turn rewards (`turn_scores`) already at the last token of the turns they reward. With a
reward model or a judge (reward.source) the two add: the environment rewards each turn, the
model the whole episode, on its last token.

Fields added for N samples, response width R: scores [N], token_level_scores [N, R], and
`score_component_<key>` [N] for each key of algorithm.gdpo_reward_keys.
"""

from __future__ import annotations

import math

import torch

from dagrl.algorithms.shaping import overlong_penalty
from dagrl.data.batch import Batch, response_attention
from dagrl.roles.registry import NodeContext, register_role


def decode_responses(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """The text of each response: [N, R] ids and mask -> N strings (special tokens dropped)."""
    ids = [row[m.bool()].tolist() for row, m in zip(responses, mask, strict=True)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def episode_texts(tokenizer, batch: Batch) -> list[str]:
    """The response of each sample as every reward reads it (rule scorer, reward model, judge):
    a multi-turn episode whole, the tool and environment messages between the policy's turns
    included (`response_attention_mask`). verl decodes a response over its attention mask for
    its reward functions and for its reward-model worker (one assistant message after the
    prompt), so a reward model or judge prompt written for verl reads the same text here; and
    only with the tools' answers in view can it tell a final answer taken from a tool from
    one made up. Single-turn: the response."""
    return decode_responses(tokenizer, batch["responses"], response_attention(batch))


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """The column of each row's last 1 in a [N, R] mask (0 for an empty row): [N]. Unlike
    `mask.sum(-1) - 1` it is right for masks with gaps."""
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)   # [R]
    return ((mask > 0) * columns).amax(-1).sub(1).clamp(min=0)


@register_role("reward", engines=("reward",), side="rollout",
               adds={"scores": "float32", "token_level_scores": "R float32"})
def reward(ctx: NodeContext, batch: Batch) -> Batch:
    if "turn_scores" in batch:   # an environment's episodes: its rewards are their score
        return _environment_scores(ctx, batch)
    texts = episode_texts(ctx.engines.tokenizer, batch)
    sample_ids = [f"{uid}/{i}" for i, uid in enumerate(batch["uid"])]
    result = ctx.engines.reward_manager.score(texts, batch["data_source"], batch["ground_truth"],
                                             batch["extra_info"], sample_ids=sample_ids)
    place_outcome_scores(ctx, batch, torch.tensor(result.scores, dtype=torch.float32))
    ctx.metrics.add_sum("reward/errors", result.n_errors)
    ctx.metrics.add_sum("reward/timeouts", result.n_timeouts)
    if result.first_error:
        ctx.engines.log(f"reward: {result.n_errors + result.n_timeouts} scorer failure(s) "
                        f"counted; first: {result.first_error}")
    for name, values in result.extra.items():
        v = torch.tensor(values, dtype=torch.float64)
        ok = ~torch.isnan(v)
        ctx.metrics.add_mean(f"reward/{name}", float(v[ok].sum()), float(ok.sum()))
    for key in ctx.config.algorithm.gdpo_reward_keys:   # GDPO's reward components
        values = result.extra.get(key)
        if values is None or any(math.isnan(v) for v in values):
            raise KeyError(f"algorithm.gdpo_reward_keys names {key!r}, but the scorer did not "
                           f"return it for every sample (its keys: {sorted(result.extra)})")
        batch[score_component_field(key)] = torch.tensor(values, dtype=torch.float32)
    return batch


def place_outcome_scores(ctx: NodeContext, batch: Batch, scores: torch.Tensor) -> None:
    """Write a sample's outcome reward (scores [N]; + DAPO's overlong shaping when configured)
    into `scores` [N] and onto its last response token in `token_level_scores` [N, R]. Every
    reward role (rule, reward model, judge) ends here. An environment's episodes (a model
    scoring them) keep its per-turn rewards beside the outcome: both are in
    `token_level_scores`, `scores` is their sum, `reward/environment/*` the environment's."""
    mask = batch["response_mask"]
    scores = scores.to(mask.device)   # scorers answer in Python floats, on the host
    r = ctx.config.reward
    if r.overlong_buffer_len:
        penalty = overlong_penalty(mask.sum(-1), max_len=ctx.config.rollout.max_new_tokens,
                                   buffer_len=r.overlong_buffer_len,
                                   penalty_factor=r.overlong_penalty_factor)
        ctx.metrics.add_mean("reward/overlong_penalty", float(penalty.sum()), len(batch))
        scores = scores + penalty
    # The outcome reward sits on the last response token (token-level credit for PPO/GAE).
    token_scores = torch.zeros_like(mask)
    token_scores[torch.arange(len(batch)), last_token_index(mask)] = scores
    if "turn_scores" in batch:
        turns = batch["turn_scores"].to(mask.dtype)
        ctx.metrics.add_distribution("reward/environment", turns.sum(-1))
        token_scores = token_scores + turns
        scores = scores + turns.sum(-1)
    batch["scores"] = scores
    batch["token_level_scores"] = token_scores * (mask.sum(-1, keepdim=True) > 0)
    ctx.metrics.add_distribution("reward", scores)


def score_component_field(key: str) -> str:
    """The batch field holding the reward component `key` of every sample ([N])."""
    return f"score_component_{key}"


def _environment_scores(ctx: NodeContext, batch: Batch) -> Batch:
    """Environment episodes: token_level_scores are the per-turn rewards where the rollout put
    them (the last token of each rewarded turn); the score is their sum."""
    token_scores = batch["turn_scores"].to(batch["response_mask"].dtype)
    batch["token_level_scores"] = token_scores
    batch["scores"] = token_scores.sum(-1)
    ctx.metrics.add_distribution("reward", batch["scores"])
    return batch
