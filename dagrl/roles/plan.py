"""From a config to each rank's task list: import user roles, build the graph (`dag.graph` or
the built-in graph of `algorithm.name`), validate it against the role registry, and plan it
(dag/planner.py). `dagrl plan`, the worker and the run report all call `plan_for`.
"""

from __future__ import annotations

import os

# The built-in roles register themselves on import.
import dagrl.roles.advantage
import dagrl.roles.filter
import dagrl.roles.forward
import dagrl.roles.generate
import dagrl.roles.model_reward
import dagrl.roles.multi_model
import dagrl.roles.score
import dagrl.roles.update  # noqa: F401
from dagrl.config.models import model_config
from dagrl.config.schema import Config
from dagrl.dag.async_placement import AsyncSides, place_async
from dagrl.dag.builtin import BUILTIN_GRAPHS, expand_use_nodes
from dagrl.dag.planner import PlanSizes, RankPlan, make_plan
from dagrl.dag.spec import GraphError, GraphSpec, load_graph_yaml, validate_graph
from dagrl.registry import Registry
from dagrl.roles.registry import ROLES, Role, import_user_modules
from dagrl.rollout.registry import rollout_backend


def load_builtin_roles() -> Registry[Role]:
    """The role registry, holding the built-in roles (and any user roles imported so far)."""
    return ROLES


def build_graph(cfg: Config) -> GraphSpec:
    """The configured graph: `dag.graph` (a built-in name or a YAML file), else the built-in
    graph of `algorithm.name`."""
    # The backend's own config checks run here too, so planning refuses what it cannot serve.
    rollout = rollout_backend(cfg)
    name = cfg.dag.graph or cfg.algorithm.name
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        # `use:` nodes become what each policy's reward.source and algorithm name
        return expand_use_nodes(load_graph_yaml(name), lambda m: model_config(cfg, m),
                                      rollout_backend)
    return BUILTIN_GRAPHS.get(name)(cfg, rollout)


def roles_on_side(side: str) -> frozenset[str]:
    """The registered roles that declare `side` (Role.side): where trainer.mode=async runs them
    (dag/async_placement.py)."""
    return frozenset(name for name in ROLES if ROLES.get(name).side == side)


def plan_for(cfg: Config, world_size: int) -> tuple[GraphSpec, list[str], list[RankPlan]]:
    """Import user roles, build and validate the graph, and plan it for `world_size` ranks
    (under tensor / sequence parallelism, the model nodes in replicas of tp x sp ranks)."""
    graph, order, plans, _ = plan_with_sides(cfg, world_size)
    return graph, order, plans


def plan_with_sides(cfg: Config, world_size: int
                    ) -> tuple[GraphSpec, list[str], list[RankPlan], AsyncSides | None]:
    """`plan_for`, and under trainer.mode=async the graph placed on its two sides first (None
    in sync mode)."""
    import_user_modules(cfg.dag.modules)
    graph = build_graph(cfg)
    order = validate_graph(graph, ROLES)
    check_node_models(graph, cfg, world_size)
    if not cfg.is_async:   # async places the sides itself (dag/async_placement.py)
        check_sharded_nodes_on_every_rank(graph, world_size)
    sides = None
    if cfg.is_async:
        refusals = {name: ROLES.get(name).async_refusal for name in ROLES
                    if ROLES.get(name).async_refusal}
        graph, order, sides = place_async(graph, order, world_size, roles_on_side("rollout"),
                                          roles_on_side("follower"), refusals)
    trains = frozenset(name for name in ROLES if ROLES.get(name).trains)
    models = frozenset(name for name in ROLES if ROLES.get(name).runs_model)
    # The training mesh is the trainer side's in async mode (engines/layout.py).
    model_ranks = sides.trainer_ranks if sides is not None else tuple(range(world_size))
    group = cfg.actor.model_parallel_size if world_size > 1 else 1
    if len(model_ranks) % group:
        a = cfg.actor
        raise GraphError(f"actor.tensor_parallel_size ({a.tensor_parallel_size}) x "
                         f"actor.sequence_parallel_size ({a.sequence_parallel_size}) must divide "
                         f"the async trainer side's {len(model_ranks)} rank(s) "
                         f"{list(model_ranks)}: use more workers (trainer.n_workers >= "
                         f"{2 * group}) or trainer.mode=sync")
    generates = frozenset(name for name in ROLES if "rollout" in ROLES.get(name).engines)
    plans = make_plan(graph, order, world_size, trains, group=group, model_roles=models,
                      model_ranks=model_ranks, rollout_roles=generates,
                      rollout_group=rollout_ranks_per_engine(cfg, graph, world_size),
                      sizes=plan_sizes(cfg, graph, order))
    return graph, order, plans, sides


def rollout_ranks_per_engine(cfg: Config, graph: GraphSpec, world_size: int) -> int:
    """The ranks each rollout engine spans (its backend's `ranks_per_engine`); every policy that
    generates must agree, since its rollout nodes share the step's one batch layout."""
    models = sorted({node.model for node in graph.nodes})
    spans = {m: rollout_backend(model_config(cfg, m)).ranks_per_engine(model_config(cfg, m))
             for m in models}
    if len(set(spans.values())) > 1:
        raise GraphError("every policy's rollout engine must span the same number of ranks "
                         "(rollout tensor parallelism; the rollout nodes share one batch "
                         f"layout), got {spans}")
    return next(iter(spans.values()))


# The per-sample tensor fields of a step's prompts (data/dataset.py), as roles declare theirs.
PROMPT_FIELDS = {"prompt_ids": "P int64", "prompt_mask": "P int64", "row_index": "int64",
                 "batch_position": "int64"}
_ITEMSIZE = {"int64": 8, "float32": 4, "float64": 8, "int32": 4, "bool": 1}


def field_bytes(spec: str, cfg: Config) -> int:
    """Bytes of one sample's field declared as "[P|R] dtype" (Role.adds)."""
    *width, dtype = spec.split()
    count = {"P": cfg.data.max_prompt_length, "R": cfg.rollout.max_new_tokens}[width[0]] \
        if width else 1
    return count * _ITEMSIZE[dtype]


def plan_sizes(cfg: Config, graph: GraphSpec, order: list[str]) -> PlanSizes:
    """Global samples and declared tensor bytes per sample as the batch reaches each node:
    the prompts' fields plus those of every earlier node (the batch flows through the plan in
    order). Bytes of pickled per-sample metadata (uid, ground truth, ...) are not counted."""
    fields = dict(PROMPT_FIELDS)
    samples, sizes = cfg.data.train_batch_size, {}
    counts = {}
    for node_id in order:
        counts[node_id] = samples
        sizes[node_id] = sum(field_bytes(spec, cfg) for spec in fields.values())
        role = graph.node(node_id).role
        fields.update(ROLES.get(role).adds)
        if ROLES.get(role).fans_out:   # rollout.n samples per prompt from here on
            samples *= cfg.rollout.n
    return PlanSizes(counts, sizes)


def check_node_models(graph: GraphSpec, cfg: Config, world_size: int) -> None:
    """Every node's `model` is one of the config's `models`, and an extra model's nodes run on
    every rank (its weights are sharded over all of them, like the main policy's)."""
    for node in graph.nodes:
        if not node.model:
            continue
        if node.model not in cfg.models:
            raise GraphError(f"graph {graph.name!r}: node {node.id!r} uses model {node.model!r}, "
                             f"which the config's `models` does not define (models: "
                             f"{sorted(cfg.models) or 'none'})")
        ranks = node.options.get("ranks")
        if ranks is not None and sorted(ranks) != list(range(world_size)):
            raise GraphError(f"graph {graph.name!r}: node {node.id!r} of model {node.model!r} "
                             f"has options.ranks {ranks}; extra models run on every rank (their "
                             "weights are sharded over all workers) — placing them on a subset "
                             "is not supported yet")


def check_sharded_nodes_on_every_rank(graph: GraphSpec, world_size: int) -> None:
    """A node whose role runs a model FSDP2 shards over every worker (engines/bundle.py: the
    actor, critic and reference passes, the reward model) has no `options.ranks` other than all
    ranks: each forward all-gathers from all workers, so on fewer ranks it would wait forever.
    (A rollout node may sit on a subset: the other ranks still join its weight gathers.)"""
    everyone = list(range(world_size))
    for node in graph.nodes:
        ranks = node.options.get("ranks")
        role = ROLES.get(node.role)
        sharded = ([e for e in role.engines if e != "rollout"]
                   if role.runs_model or "reward_model" in role.engines else [])
        if world_size > 1 and ranks is not None and sorted(ranks) != everyone and sharded:
            raise GraphError(f"graph {graph.name!r}: node {node.id!r} has options.ranks "
                             f"{ranks}, but its role {node.role!r} runs the {sharded[0]} model, "
                             f"whose weights are sharded over all {world_size} workers (FSDP2): "
                             "run it on every rank (drop its options.ranks)")


def engines_of(plan: RankPlan, model: str = "") -> set[str]:
    """The engines (dagrl.roles.registry.ENGINES names) of policy `model` ('' = the main one)
    that the nodes of one rank's plan use."""
    return {e for t in plan.tasks if t.kind == "node" and t.model == model
            for e in ROLES.get(t.role).engines}
