"""Roles that generate: `rollout` (rollout.n samples per prompt) and `greedy_baseline` (ReMax).

Fields `rollout` adds, for a shard of N samples (the prompts repeated rollout.n times, so a
prompt's group stays on one rank) and response width R:
    responses [N, R], response_mask [N, R], rollout_logprobs [N, R], sample_seed [N]
"""

from __future__ import annotations

import zlib

import torch

from dagrl.data.batch import Batch
from dagrl.roles.registry import NodeContext, register_role
from dagrl.roles.score import decode_responses
from dagrl.rollout.sampling import SamplingParams, mix_seed


def index_within_group(uids) -> torch.Tensor:
    """For consecutive rows grouped by uid: each row's position in its group, [N]."""
    out, previous, k = [], None, 0
    for uid in uids:
        k = k + 1 if uid == previous else 0
        out.append(k)
        previous = uid
    return torch.tensor(out, dtype=torch.long)


@register_role("rollout", engines=("rollout", "actor"),
               adds={"responses": "R int64", "response_mask": "R float32",
                     "rollout_logprobs": "R float32", "sample_seed": "int64"})
def rollout(ctx: NodeContext, batch: Batch) -> Batch:
    cfg = ctx.config.rollout
    if ctx.node.model:
        # Another policy (roles/multi_model.py) answers each of the main policy's samples once;
        # the samples of a group are consecutive rows, so a row's index within its group is
        # the same on any number of workers. The model's name salts its randomness.
        sample_index = index_within_group(batch["uid"])
        salt = zlib.crc32(ctx.node.model.encode())
    else:
        n_prompts = len(batch)
        batch = batch.repeat_interleave(cfg.n)
        sample_index = torch.arange(cfg.n).repeat(n_prompts)
        salt = 0
    # Randomness keyed by (seed, step, dataset row, sample index): see rollout/sampling.py.
    batch["sample_seed"] = mix_seed(ctx.config.trainer.seed ^ salt, ctx.step, batch["row_index"],
                                    sample_index)
    engine = ctx.engines.rollout
    out = engine.generate(batch["prompt_ids"], batch["prompt_mask"], batch["sample_seed"],
                          SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p),
                          max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens)
    batch["responses"] = out.responses
    batch["response_mask"] = out.response_mask
    batch["rollout_logprobs"] = out.logprobs
    lengths = out.response_mask.sum(-1)
    ctx.metrics.add_distribution("response/length", lengths)
    stop = torch.tensor(engine.stop_token_ids, device=out.responses.device)
    ended = (torch.isin(out.responses, stop) & out.response_mask.bool()).any(-1).float()
    ctx.metrics.add_mean("response/clip_ratio", float((1 - ended).sum()), len(batch))
    ctx.metrics.add_mean("prompt/length_mean", float(batch["prompt_mask"].sum()), len(batch))
    ctx.metrics.add_sum("tokens/total", float(lengths.sum() + batch["prompt_mask"].sum()))
    return batch


@register_role("greedy_baseline", engines=("rollout", "reward"),
               adds={"baseline_scores": "float32"})
def greedy_baseline(ctx: NodeContext, batch: Batch) -> Batch:
    """ReMax: the reward of the greedy response to each prompt, the baseline of its samples.
    Adds baseline_scores [prompts]; the rollout node repeats it with the prompt."""
    cfg = ctx.config.rollout
    out = ctx.engines.rollout.generate(
        batch["prompt_ids"], batch["prompt_mask"], torch.zeros(len(batch), dtype=torch.long),
        SamplingParams(temperature=0.0), max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens)
    texts = decode_responses(ctx.engines.tokenizer, out.responses, out.response_mask)
    result = ctx.engines.reward_manager.score(texts, batch["data_source"], batch["ground_truth"],
                                             batch["extra_info"],
                                             sample_ids=[f"{u}/greedy" for u in batch["uid"]])
    batch["baseline_scores"] = torch.tensor(result.scores, dtype=torch.float32)
    ctx.metrics.add_distribution("reward/greedy_baseline", batch["baseline_scores"])
    return batch
