"""The built-in DAG roles. Each is `fn(ctx, batch) -> batch` on this worker's shard.

Fields each role adds to the batch (shapes for a shard of N samples, response width R):
  rollout      responses [N,R], response_mask [N,R], rollout_logprobs [N,R], sample_seed [N]
               (the prompt batch is first repeated rollout.n times: a group stays on one rank)
  reward       scores [N], token_level_scores [N,R] (the score on the last response token)
  old_logprob  old_logprobs [N,R]   (the actor before this step's update)
  ref_logprob  ref_logprobs [N,R]
  advantage    advantages [N,R], returns [N,R]
  actor_update (updates the actor; adds nothing)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dagrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from dagrl.config.schema import Config
from dagrl.dag.roles import register_role
from dagrl.dag.spec import NodeSpec
from dagrl.data.batch import Batch
from dagrl.engines.forward import batch_logprobs
from dagrl.engines.sampling import SamplingParams, mix_seed
from dagrl.observe.metrics import StepMetrics
from dagrl.runtime.engines import Engines


@dataclass
class NodeContext:
    """What a node function may use: the config, its node, the step, this worker's engines and
    the step's metrics."""
    config: Config
    node: NodeSpec
    step: int
    rank: int
    world_size: int
    engines: Engines
    metrics: StepMetrics


@register_role("rollout", engines=("rollout", "actor"))
def rollout(ctx: NodeContext, batch: Batch) -> Batch:
    cfg = ctx.config.rollout
    n_prompts = len(batch)
    batch = batch.repeat_interleave(cfg.n)
    sample_index = torch.arange(cfg.n).repeat(n_prompts)
    # Randomness keyed by (seed, step, dataset row, sample index): see engines/sampling.py.
    batch["sample_seed"] = mix_seed(ctx.config.trainer.seed, ctx.step, batch["row_index"],
                                    sample_index)
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    out = ctx.engines.generator.generate(batch["prompt_ids"], batch["prompt_mask"],
                                         batch["sample_seed"], params,
                                         max_new_tokens=cfg.max_new_tokens,
                                         min_new_tokens=cfg.min_new_tokens)
    batch["responses"] = out.responses
    batch["response_mask"] = out.response_mask
    batch["rollout_logprobs"] = out.logprobs
    lengths = out.response_mask.sum(-1)
    ctx.metrics.add_distribution("response/length", lengths)
    eos = ctx.engines.tokenizer.eos_token_id
    ended = (out.responses == eos).any(-1).float()
    ctx.metrics.add_mean("response/clip_ratio", float((1 - ended).sum()), len(batch))
    ctx.metrics.add_mean("prompt/length_mean", float(batch["prompt_mask"].sum()), len(batch))
    ctx.metrics.add_sum("tokens/total", float(lengths.sum() + batch["prompt_mask"].sum()))
    return batch


def decode_responses(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    ids = [row[m.bool()].tolist() for row, m in zip(responses, mask)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


@register_role("reward", engines=("reward",))
def reward(ctx: NodeContext, batch: Batch) -> Batch:
    texts = decode_responses(ctx.engines.tokenizer, batch["responses"], batch["response_mask"])
    sample_ids = [f"{uid}/{i}" for i, uid in enumerate(batch["uid"])]
    result = ctx.engines.reward_manager.score(texts, batch["data_source"], batch["ground_truth"],
                                             batch["extra_info"], sample_ids=sample_ids)
    scores = torch.tensor(result.scores, dtype=torch.float32)
    mask = batch["response_mask"]
    # The outcome reward sits on the last response token (token-level credit for PPO/GAE).
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    token_scores = torch.zeros_like(mask)
    token_scores[torch.arange(len(batch)), last] = scores
    batch["scores"] = scores
    batch["token_level_scores"] = token_scores * (mask.sum(-1, keepdim=True) > 0)
    ctx.metrics.add_distribution("reward", scores)
    ctx.metrics.add_sum("reward/errors", result.n_errors)
    if result.first_error:
        ctx.engines.log(f"reward: {result.n_errors} scorer failure(s) counted; first: "
                        f"{result.first_error}")
    for name, values in result.extra.items():
        v = torch.tensor(values, dtype=torch.float64)
        ok = ~torch.isnan(v)
        ctx.metrics.add_mean(f"reward/{name}", float(v[ok].sum()), float(ok.sum()))
    return batch


@register_role("old_logprob", engines=("actor",))
def old_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    actor = ctx.engines.actor
    batch["old_logprobs"] = actor.compute_logprobs(batch, ctx.config.actor.micro_batch_size)
    if "rollout_logprobs" in batch:
        # Rollout and training compute the same quantity: a gap means a numerics mismatch.
        mask = batch["response_mask"]
        gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * mask
        ctx.metrics.add_mean("actor/rollout_logprob_gap", float(gap.sum()), float(mask.sum()))
    return batch


@register_role("ref_logprob", engines=("ref",))
def ref_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    temperature = ctx.config.rollout.temperature or 1.0
    batch["ref_logprobs"] = batch_logprobs(ctx.engines.ref_model, batch,
                                           micro_batch_size=ctx.config.ref.micro_batch_size,
                                           temperature=temperature)
    return batch


def group_index(uids: np.ndarray) -> torch.Tensor:
    """Dense group ids from per-sample prompt uids: [N] object -> [N] int64."""
    _, inverse = np.unique(np.asarray(uids, dtype=str), return_inverse=True)
    return torch.as_tensor(inverse, dtype=torch.long)


@register_role("advantage")
def advantage(ctx: NodeContext, batch: Batch) -> Batch:
    algo = ctx.config.algorithm
    estimator = ADVANTAGE_ESTIMATORS.get(algo.adv_estimator)
    adv, returns = estimator(batch["token_level_scores"], batch["response_mask"],
                             group_index(batch["uid"]), norm_by_std=algo.norm_adv_by_std)
    batch["advantages"], batch["returns"] = adv, returns
    mask = batch["response_mask"]
    ctx.metrics.add_mean("advantage/mean", float((adv * mask).sum()), float(mask.sum()))
    return batch


@register_role("actor_update", engines=("actor",), trains=True)
def actor_update(ctx: NodeContext, batch: Batch) -> Batch:
    ctx.engines.actor.update(batch, ctx.metrics)
    # New weights go to the rollout generator now, while every actor rank is here to gather.
    ctx.metrics.add_max("timing/weight_sync_s", ctx.engines.sync_rollout_weights())
    return batch
