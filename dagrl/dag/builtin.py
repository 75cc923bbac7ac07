"""Built-in graphs, one per algorithm, selected by `algorithm.name` (with the settings of
`dagrl/config/presets.py`). `dagrl plan algorithm.name=X` shows each.

All are variations of one policy-gradient graph:

    [greedy_baseline] -> rollout -> reward -> [filter] -> [old_logprob], [ref_logprob], [values]
                      -> [kl_penalty] -> advantage -> actor_update, [critic_update]

A graph function receives the config because a node's presence can depend on it: the
reference model is only built (and its node only planned) when a KL term uses it. It also
receives the rollout backend's declared capabilities (`RolloutTraits`), which the caller looks up
(`dagrl.rollout.rollout_backend(cfg)`, in roles/plan.py): dag/ sits below rollout/ and cannot.

The part from the reward on (`training_nodes`) is also what a hand-written graph's
`use: algorithm` node stands for (`expand_use_nodes`), so YAML graphs of several policies get
each policy's algorithm without copying its nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from dagrl.config.schema import Config
from dagrl.dag.spec import USE_ALGORITHM, USE_REWARD, GraphError, GraphSpec, NodeSpec
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
    nodes += training_nodes(cfg, rollout, ("reward",), dynamic_sampling=dynamic_sampling,
                            critic=critic)
    return GraphSpec(name, tuple(nodes))


def training_nodes(cfg: Config, rollout: RolloutTraits, after: tuple[str, ...], *,
                   dynamic_sampling: bool = False, critic: bool = False,
                   model: str = "") -> list[NodeSpec]:
    """A policy's nodes from its scored samples (`after`) to its update: [filter] ->
    [old_logprob], [ref_logprob], [values] -> [kl_penalty] -> advantage -> actor_update,
    [critic_update]. An extra model's (`model`) ids carry its name: refiner_advantage."""
    def node(role: str, deps: tuple[str, ...]) -> NodeSpec:
        return NodeSpec(f"{model}_{role}" if model else role, role, deps, model=model)

    nodes = []
    source = after    # what the forward passes read: the batch after filtering, if any
    if dynamic_sampling:
        nodes.append(node("filter", after))
        source = (nodes[-1].id,)
    forward = []
    if uses_old_logprob(cfg, rollout):
        nodes.append(node("old_logprob", source))
        forward.append(nodes[-1])
    if uses_reference(cfg):
        nodes.append(node("ref_logprob", source))
        forward.append(nodes[-1])
    if critic:
        nodes.append(node("values", source))
        forward.append(nodes[-1])
    if cfg.algorithm.kl_in_reward:   # r = score - beta * KL(pi_old || pi_ref), per token
        nodes.append(node("kl_penalty", (*source, *(f.id for f in forward))))
        forward = [nodes[-1], *(f for f in forward if f.role == "values")]
    nodes.append(node("advantage", (*source, *(f.id for f in forward))))
    advantage = nodes[-1].id
    nodes.append(node("actor_update", (advantage,)))
    if critic:
        nodes.append(node("critic_update", (advantage,)))
    return nodes


# What each built-in algorithm adds to the policy-gradient graph (filled by _register).
GRAPH_SHAPES: dict[str, dict[str, bool]] = {}


def expand_use_nodes(graph: GraphSpec, config_of: Callable[[str], Config],
                     traits_of: Callable[[Config], RolloutTraits]) -> GraphSpec:
    """Replace each `use: reward` node of a hand-written graph (dag/spec.py) by the role of its
    policy's reward.source, and each `use: algorithm` node by the training nodes of its
    policy's algorithm (`config_of(model).algorithm.name`); a node that depended on the latter
    depends on the policy's updates.

    DAPO's filter drops groups of the batch, which every policy shares (an extra model answers
    each of the main policy's samples once): the main policy's algorithm filters, and an extra
    model whose algorithm filters too trains on the groups the main filter kept (its nodes
    follow that filter)."""
    graph = GraphSpec(graph.name, tuple(
        replace(n, role=REWARD_ROLES[config_of(n.model).reward.source])
        if n.role == USE_REWARD else n for n in graph.nodes))
    macros = [n for n in graph.nodes if n.role == USE_ALGORITHM]
    if not macros:
        return graph
    shapes = {n.id: _shape(graph, n, config_of(n.model).algorithm.name) for n in macros}
    main_filter = [n.id for n in graph.nodes if n.role == "filter" and not n.model]
    main_filter += ["filter" for n in macros
                    if not n.model and shapes[n.id].get("dynamic_sampling")]
    expanded: list[NodeSpec] = []
    updates: dict[str, tuple[str, ...]] = {}
    for n in graph.nodes:
        if n.role != USE_ALGORITHM:
            expanded.append(n)
            continue
        cfg, shape, after = config_of(n.model), shapes[n.id], n.deps
        filters = bool(shape.get("dynamic_sampling"))
        if filters and n.model:
            if not main_filter:
                raise GraphError(f"graph {graph.name!r}: node {n.id!r} (use: algorithm, "
                                 f"{cfg.algorithm.name}) of model {n.model!r}: DAPO's filter "
                                 "drops groups of the batch every policy shares, so an extra "
                                 "model trains on the groups the main policy's filter keeps; "
                                 "the main policy runs no filter")
            after, filters = (*after, *main_filter), False
        nodes = training_nodes(cfg, traits_of(cfg), after, model=n.model, dynamic_sampling=filters,
                               critic=bool(shape.get("critic")))
        expanded += nodes
        updates[n.id] = tuple(x.id for x in nodes if x.role in ("actor_update", "critic_update"))
    rewired = [replace(n, deps=tuple(d for dep in n.deps for d in updates.get(dep, (dep,))))
               for n in expanded]
    return GraphSpec(graph.name, tuple(rewired))


def _shape(graph: GraphSpec, node: NodeSpec, name: str) -> dict[str, bool]:
    where = f"graph {graph.name!r}: node {node.id!r} (use: algorithm, {name})"
    shape = GRAPH_SHAPES.get(name)
    if shape is None:
        raise GraphError(f"{where}: no built-in graph of that name to take the nodes from "
                         f"({', '.join(sorted(GRAPH_SHAPES))})")
    if shape.get("greedy_baseline"):
        raise GraphError(f"{where}: the greedy baseline is a second rollout, before the scored "
                         "samples this node starts from; write its greedy_baseline node before "
                         "the rollout and the training nodes by hand")
    if node.options:
        raise GraphError(f"{where}: takes no options (the config's sections set them)")
    return shape


def _register(name: str, doc: str, **kwargs) -> None:
    def build(cfg: Config, rollout: RolloutTraits) -> GraphSpec:
        return policy_graph(name, cfg, rollout, **kwargs)

    build.__doc__ = doc
    BUILTIN_GRAPHS.add(name, build)
    GRAPH_SHAPES[name] = kwargs


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
