"""What `dagrl plan` prints about the algorithm: the estimator, loss, aggregation and KL terms a
config selects, each with the first paragraph of its registered function's docstring (which
names its paper)."""

from __future__ import annotations

import inspect

from dagrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from dagrl.algorithms.kl import KL_ESTIMATORS
from dagrl.algorithms.policy_loss import POLICY_LOSSES, pinned_agg_mode
from dagrl.config.schema import AlgorithmConfig


def summary(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def describe_algorithm(algo: AlgorithmConfig) -> list[str]:
    """One line per active component of ``algo`` (what `dagrl plan` shows)."""
    loss = POLICY_LOSSES.get(algo.policy_loss)
    pinned = pinned_agg_mode(loss)
    agg = (f"{pinned} (pinned by {algo.policy_loss}; {algo.loss_agg_mode} for the other terms)"
           if pinned and pinned != algo.loss_agg_mode else algo.loss_agg_mode)
    lines = [
        f"  adv_estimator  {algo.adv_estimator}: "
        f"{summary(ADVANTAGE_ESTIMATORS.get(algo.adv_estimator))}",
        f"  policy_loss    {algo.policy_loss}: {summary(loss)}",
        f"  loss_agg_mode  {agg}",
    ]
    if algo.kl_loss_coef > 0:
        lines.append(f"  kl_loss        {algo.kl_loss_type} x {algo.kl_loss_coef:g}: "
                     f"{summary(KL_ESTIMATORS.get(algo.kl_loss_type))}")
    if algo.kl_in_reward:
        lines.append(f"  kl_in_reward   {algo.kl_reward_type}, {algo.kl_ctrl} beta "
                     f"{algo.kl_coef:g}: {summary(KL_ESTIMATORS.get(algo.kl_reward_type))}")
    rc = algo.rollout_correction
    if rc.active or algo.bypass_mode:
        parts = [f"is={rc.rollout_is or 'none'} (threshold {rc.rollout_is_threshold})",
                 f"rs={rc.rollout_rs or 'none'}"]
        if algo.bypass_mode:
            parts.append(f"bypass loss_type={rc.loss_type}")
        lines.append(f"  rollout_corr   {', '.join(parts)}")
    return [f"algorithm {algo.name}:", *lines]
