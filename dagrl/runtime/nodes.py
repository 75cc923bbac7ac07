"""The built-in DAG roles. Each is `fn(ctx, batch) -> batch` on this worker's shard.

Fields each role adds to the batch (shapes for a shard of N samples, response width R):
  rollout      responses [N,R], response_mask [N,R], rollout_logprobs [N,R], sample_seed [N]
               (the prompt batch is first repeated rollout.n times: a group stays on one rank)
  reward       scores [N], token_level_scores [N,R] (the score on the last response token)
  old_logprob  old_logprobs [N,R]   (the actor before this step's update)
  ref_logprob  ref_logprobs [N,R]
  advantage    token_level_rewards [N,R] (scores, minus a KL penalty if configured),
               advantages [N,R], returns [N,R]
  actor_update (updates the actor; adds nothing)
  greedy_baseline  baseline_scores [N]: the reward of a greedy response to each prompt (ReMax)
  filter       keeps only groups whose rewards vary, generating more until the batch is full
  values       values [N,R] (critic)
  critic_update (updates the critic)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dagrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from dagrl.algorithms.kl_control import apply_kl_penalty
from dagrl.algorithms.shaping import groups_with_variance, overlong_penalty
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
    # Sums a tensor over the ranks running this node (identity on one rank): global statistics
    # (whitening, KL, counts) come from reduced sums, never from moving the batch.
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    # Runs the nodes before this one again on fresh prompts (DAPO's dynamic sampling).
    more: Callable[[], Batch] | None = None


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
    stop = torch.tensor(ctx.engines.generator.stop_token_ids, device=out.responses.device)
    ended = (torch.isin(out.responses, stop) & out.response_mask.bool()).any(-1).float()
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
    r = ctx.config.reward
    if r.overlong_buffer_len:
        penalty = overlong_penalty(mask.sum(-1), max_len=ctx.config.rollout.max_new_tokens,
                                   buffer_len=r.overlong_buffer_len,
                                   penalty_factor=r.overlong_penalty_factor)
        ctx.metrics.add_mean("reward/overlong_penalty", float(penalty.sum()), len(batch))
        scores = scores + penalty
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


def _advantage_inputs(ctx: NodeContext, batch: Batch) -> dict:
    """Everything an advantage estimator may ask for; each takes what its signature names."""
    algo = ctx.config.algorithm
    rewards = batch["token_level_scores"]
    mask = batch["response_mask"]
    if algo.kl_in_reward:
        ctrl = ctx.engines.kl_controller
        rewards, kl = apply_kl_penalty(rewards, batch["old_logprobs"], batch["ref_logprobs"], mask,
                                       coef=ctrl.value, kind=algo.kl_reward_type)
        totals = ctx.reduce_sum(torch.tensor([float((kl * mask).sum()), float(mask.sum()),
                                              float(len(batch))], dtype=torch.float64))
        ctx.metrics.add_mean("actor/reward_kl", float((kl * mask).sum()), float(mask.sum()))
        ctx.metrics.add_mean("actor/kl_coef", ctrl.value, 1.0)
        ctrl.update(float(totals[0] / totals[1].clamp(min=1)), int(totals[2]))
    batch["token_level_rewards"] = rewards
    optional = {k: batch[k] for k in ("values", "baseline_scores") if k in batch}
    return dict(token_level_rewards=rewards, response_mask=mask,
                group_index=group_index(batch["uid"]), reducer=ctx.reduce_sum,
                gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_adv_by_std, **optional)


@register_role("advantage")
def advantage(ctx: NodeContext, batch: Batch) -> Batch:
    name = ctx.config.algorithm.adv_estimator
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    available = _advantage_inputs(ctx, batch)
    kwargs = {}
    for param in inspect.signature(estimator).parameters.values():
        if param.name in available:
            kwargs[param.name] = available[param.name]
        elif param.default is inspect.Parameter.empty:
            raise KeyError(f"node {ctx.node.id!r}: advantage estimator {name!r} needs "
                           f"{param.name!r} in the batch (add the node that computes it)")
    adv, returns = estimator(**kwargs)
    batch["advantages"], batch["returns"] = adv, returns
    mask = batch["response_mask"]
    ctx.metrics.add_mean("advantage/mean", float((adv * mask).sum()), float(mask.sum()))
    ctx.metrics.add_mean("advantage/abs_mean", float((adv.abs() * mask).sum()), float(mask.sum()))
    return batch


@register_role("greedy_baseline", engines=("rollout", "reward"))
def greedy_baseline(ctx: NodeContext, batch: Batch) -> Batch:
    """ReMax: the reward of the greedy response to each prompt, the baseline of its samples."""
    cfg = ctx.config.rollout
    out = ctx.engines.generator.generate(
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


def _count_groups(batch: Batch) -> int:
    return len(set(batch["uid"].tolist())) if len(batch) else 0


@register_role("filter")
def filter_groups(ctx: NodeContext, batch: Batch) -> Batch:
    """DAPO dynamic sampling: keep groups whose rewards vary (a group that is all right or all
    wrong has zero advantage and only dilutes the batch); generate again on fresh prompts until
    data.train_batch_size groups are kept over all ranks, at most algorithm.filter_max_rounds
    rounds. Every rank takes the same decisions, from globally summed counts."""
    algo, target = ctx.config.algorithm, ctx.config.data.train_batch_size
    kept = batch.select(groups_with_variance(batch["scores"], group_index(batch["uid"])))
    generated = _count_groups(batch)
    rounds = 1
    while True:
        counts = ctx.reduce_sum(torch.tensor([_count_groups(kept), generated], dtype=torch.float64))
        total = int(counts[0])
        if total >= target or rounds >= algo.filter_max_rounds or ctx.more is None:
            break
        fresh = ctx.more()
        generated += _count_groups(fresh)
        kept = Batch.concat([kept, fresh.select(groups_with_variance(
            fresh["scores"], group_index(fresh["uid"])))])
        rounds += 1
    ctx.metrics.add_max("filter/rounds", rounds)
    ctx.metrics.add_sum("filter/groups_kept", min(total, target))
    ctx.metrics.add_mean("filter/keep_rate", float(counts[0]), float(counts[1]))
    keep = target
    if total < target:
        if algo.filter_on_cap == "error" or total < ctx.world_size:
            raise RuntimeError(
                f"node {ctx.node.id!r}: only {total} of {target} groups had varying rewards after "
                f"{rounds} generation round(s) (algorithm.filter_max_rounds="
                f"{algo.filter_max_rounds}); raise it, or set algorithm.filter_on_cap=partial")
        keep = total - total % ctx.world_size   # equal group counts per rank for the update
        ctx.engines.log(f"filter: training on a partial batch of {keep}/{target} groups")
    return _first_groups(ctx, kept, keep)


def _first_groups(ctx: NodeContext, batch: Batch, keep: int) -> Batch:
    """Keep the first `keep` groups of the global order (rank by rank)."""
    mine = _count_groups(batch)
    per_rank = torch.zeros(ctx.world_size, dtype=torch.float64)
    per_rank[ctx.rank] = mine
    per_rank = ctx.reduce_sum(per_rank)
    before = int(per_rank[:ctx.rank].sum())
    allowed = max(0, min(mine, keep - before))
    uids = batch["uid"].tolist()
    first = set(list(dict.fromkeys(uids))[:allowed])
    return batch.select([i for i, u in enumerate(uids) if u in first])


@register_role("values", engines=("critic",))
def values(ctx: NodeContext, batch: Batch) -> Batch:
    batch["values"] = ctx.engines.critic.compute_values(batch)
    return batch


@register_role("critic_update", engines=("critic",), trains=True)
def critic_update(ctx: NodeContext, batch: Batch) -> Batch:
    ctx.engines.critic.update(batch, ctx.metrics)
    return batch


@register_role("actor_update", engines=("actor",), trains=True)
def actor_update(ctx: NodeContext, batch: Batch) -> Batch:
    ctx.engines.actor.update(batch, ctx.metrics)
    # New weights go to the rollout generator now, while every actor rank is here to gather.
    ctx.metrics.add_max("timing/weight_sync_s", ctx.engines.sync_rollout_weights())
    return batch
