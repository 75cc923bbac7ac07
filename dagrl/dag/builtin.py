"""Built-in graphs, one per algorithm, selected by `algorithm.name` (with the settings of
`dagrl/config/presets.py`). `dagrl plan algorithm.name=X` shows each.

All are variations of one policy-gradient graph:

    [greedy_baseline] -> rollout -> reward -> [filter] -> [old_logprob], [ref_logprob], [values]
                      -> [kl_penalty] -> advantage -> actor_update, [critic_update]

A graph function receives the config because a node's presence can depend on it: the
reference model is only built (and its node only planned) when a KL term uses it. It also
receives the rollout backend's declared capabilities (`RolloutTraits`), which the caller looks up
(`dagrl.rollout.rollout_backend(cfg)`, in roles/plan.py): dag/ sits below rollout/ and cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dagrl.config.schema import Config
from dagrl.dag.spec import GraphSpec, NodeSpec
from dagrl.registry import Registry

# The role of the `reward` node for each reward.source (roles/score.py, roles/model_reward.py).
REWARD_ROLES = {"rule": "reward", "reward_model": "reward_model", "judge": "judge"}


class RolloutTraits(Protocol):
    """What a graph reads of the configured rollout backend (a `dagrl.rollout.RolloutBackend`
    class, whose docstrings give the physical reasons)."""

    # Its log-probs are computed with the trainer's numerics: equal to pi_old when the policy
    # has not moved since it generated.
    trainer_numerics: bool


GraphBuilder = Callable[[Config, RolloutTraits], GraphSpec]

BUILTIN_GRAPHS: Registry[GraphBuilder] = Registry("built-in graph")


def uses_reference(cfg: Config) -> bool:
    return cfg.algorithm.kl_loss_coef > 0 or cfg.algorithm.kl_in_reward


def one_update_per_batch(cfg: Config) -> bool:
    """Whether each batch gets exactly one optimizer step: then the actor being updated is the
    policy that generated the batch."""
    return cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size == cfg.data.train_batch_size


def uses_old_logprob(cfg: Config, rollout: RolloutTraits) -> bool:
    """The old_logprob pass is needed unless pi_old = pi (see actor.skip_on_policy_old_logprob);
    a KL penalty in the reward reads pi_old before the update, so it always needs the pass. A
    backend without the trainer's numerics (vLLM's kernels, a server's, or its frozen weights)
    gives log-probs that are not pi_old, so the trainer recomputes them. Some algorithms read
    pi_old themselves (the optimal token baseline, the rollout correction:
    `AlgorithmConfig.needs_old_logprob`); in verl's bypass mode (policy_loss=bypass_mode) pi_old
    is the rollout policy and the pass is left out."""
    algo = cfg.algorithm
    if algo.kl_in_reward or algo.needs_old_logprob:
        return True
    if algo.bypass_mode:   # the loss takes the rollout's log-probs as pi_old
        return False
    return (not cfg.actor.skip_on_policy_old_logprob or not one_update_per_batch(cfg)
            or not rollout.trainer_numerics)


def policy_graph(name: str, cfg: Config, rollout: RolloutTraits, *,
                 greedy_baseline: bool = False, dynamic_sampling: bool = False,
                 critic: bool = False) -> GraphSpec:
    nodes = []
    if greedy_baseline:
        nodes.append(NodeSpec("greedy_baseline", "greedy_baseline"))
    nodes.append(NodeSpec("rollout", "rollout", ("greedy_baseline",) if greedy_baseline else ()))
    # reward.source picks the role that scores: rule scorers, a reward model or a judge.
    nodes.append(NodeSpec("reward", REWARD_ROLES[cfg.reward.source], ("rollout",)))
    source = "reward"    # what the forward passes read: the batch after filtering, if any
    if dynamic_sampling:
        nodes.append(NodeSpec("filter", "filter", ("reward",)))
        source = "filter"
    forward = []
    if uses_old_logprob(cfg, rollout):
        nodes.append(NodeSpec("old_logprob", "old_logprob", (source,)))
        forward.append("old_logprob")
    if uses_reference(cfg):
        nodes.append(NodeSpec("ref_logprob", "ref_logprob", (source,)))
        forward.append("ref_logprob")
    if critic:
        nodes.append(NodeSpec("values", "values", (source,)))
        forward.append("values")
    if cfg.algorithm.kl_in_reward:   # r = score - beta * KL(pi_old || pi_ref), per token
        nodes.append(NodeSpec("kl_penalty", "kl_penalty", (source, *forward)))
        forward = ["kl_penalty", *(f for f in forward if f == "values")]
    nodes.append(NodeSpec("advantage", "advantage", (source, *forward)))
    nodes.append(NodeSpec("actor_update", "actor_update", ("advantage",)))
    if critic:
        nodes.append(NodeSpec("critic_update", "critic_update", ("advantage",)))
    return GraphSpec(name, tuple(nodes))


def _register(name: str, doc: str, **kwargs) -> None:
    def build(cfg: Config, rollout: RolloutTraits) -> GraphSpec:
        return policy_graph(name, cfg, rollout, **kwargs)

    build.__doc__ = doc
    BUILTIN_GRAPHS.add(name, build)


_register("grpo", "GRPO (Shao et al. 2024): group-normalised rewards, clipped loss, KL loss term.")
_register("drgrpo", "Dr.GRPO (Liu et al. 2025): GRPO without std and length normalisation.")
_register("gspo", "GSPO (Zheng et al. 2025): sequence-level importance ratio and clipping.")
_register("cpgd", "CPGD (Liu et al. 2025): clipped log-ratio objective with policy drift.")
_register("rloo", "RLOO (Ahmadian et al. 2024): leave-one-out baseline.")
_register("reinforce_pp", "REINFORCE++ (Hu 2025): globally whitened returns.")
_register("dapo", "DAPO (Yu et al. 2025): dynamic sampling, clip-higher, token-level loss.",
          dynamic_sampling=True)
_register("remax", "ReMax (Li et al. 2023): greedy-rollout reward as the baseline.",
          greedy_baseline=True)
_register("ppo", "PPO (Schulman et al. 2017): critic, GAE advantages, value clipping.",
          critic=True)
