"""Credit assignment: the KL penalty folded into the reward (`kl_penalty`) and the advantage
estimator (`advantage`).

    kl_penalty   token_level_rewards = token_level_scores − β·KL(π_old ‖ π_ref) per token
    advantage    advantages [N, R], returns [N, R] from the estimator algorithm.adv_estimator
                 (token_level_rewards is the scores when no kl_penalty node ran)
"""

from __future__ import annotations

import numpy as np
import torch

from dagrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from dagrl.algorithms.kl_control import apply_kl_penalty, controller_kl_sums
from dagrl.data.batch import Batch
from dagrl.roles.registry import NodeContext, register_role
from dagrl.roles.score import score_component_field


def group_index(uids: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """Dense group ids from per-sample prompt uids: [N] object -> [N] int64 (on `device`)."""
    _, inverse = np.unique(np.asarray(uids, dtype=str), return_inverse=True)
    return torch.as_tensor(inverse, dtype=torch.long, device=device)


@register_role("kl_penalty", adds={"token_level_rewards": "R float32"})
def kl_penalty(ctx: NodeContext, batch: Batch) -> Batch:
    """r_t = s_t − β·KL_t, KL_t estimated (algorithm.kl_reward_type) from old_logprobs and
    ref_logprobs. β comes from the KL controller, which then steps on the batch mean of the
    per-sequence mean KL (verl's quantity, `controller_kl_sums`; summed over the ranks, so every
    rank's controller takes the same step). `actor/reward_kl` reports that quantity."""
    algo, ctrl, mask = ctx.config.algorithm, ctx.engines.kl_controller, batch["response_mask"]
    rewards, kl = apply_kl_penalty(batch["token_level_scores"], batch["old_logprobs"],
                                   batch["ref_logprobs"], mask, coef=ctrl.value,
                                   kind=algo.kl_reward_type)
    local = controller_kl_sums(kl, mask)  # [2] = (Σ_i per-sequence mean KL, B)
    totals = ctx.reduce_sum(local.clone())
    ctx.metrics.add_mean("actor/reward_kl", float(local[0]), float(local[1]))
    ctx.metrics.add_mean("actor/kl_coef", ctrl.value, 1.0)
    ctrl.update(float(totals[0] / totals[1].clamp(min=1)), int(totals[1]))
    batch["token_level_rewards"] = rewards
    return batch


@register_role("advantage", adds={"token_level_rewards": "R float32",
                                  "advantages": "R float32", "returns": "R float32"})
def advantage(ctx: NodeContext, batch: Batch) -> Batch:
    algo = ctx.config.algorithm
    if "token_level_rewards" not in batch:
        if algo.kl_in_reward:
            raise KeyError(f"node {ctx.node.id!r}: algorithm.kl_in_reward=true but no kl_penalty "
                           "node ran before it; add one (after old_logprob and ref_logprob)")
        batch["token_level_rewards"] = batch["token_level_scores"]
    mask = batch["response_mask"]
    components = {key: batch[score_component_field(key)] for key in algo.gdpo_reward_keys}
    inputs = AdvantageInputs(
        batch["token_level_rewards"], mask, group_index=group_index(batch["uid"], mask.device),
        values=batch.get("values"), baseline_scores=batch.get("baseline_scores"),
        old_logprobs=batch.get("old_logprobs"), sum_pi_squared=batch.get("sum_pi_squared"),
        rollout_is_weights=batch.get("rollout_is_weights"),
        reward_components=components or None,
        reward_weights=algo.gdpo_reward_weights or None,
        reducer=ctx.reduce_sum, gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_adv_by_std)
    estimator = ADVANTAGE_ESTIMATORS.get(algo.adv_estimator)
    try:
        adv, returns = estimator(inputs)
    except KeyError as err:   # a missing input: say which node and estimator
        raise KeyError(f"node {ctx.node.id!r}, estimator {algo.adv_estimator!r}: "
                       f"{err.args[0]}") from None
    batch["advantages"], batch["returns"] = adv, returns
    ctx.metrics.add_mean("advantage/mean", float((adv * mask).sum()), float(mask.sum()))
    ctx.metrics.add_mean("advantage/abs_mean", float((adv.abs() * mask).sum()), float(mask.sum()))
    return batch
