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
from dagrl.config.schema import Config
from dagrl.dag.builtin import BUILTIN_GRAPHS
from dagrl.dag.planner import RankPlan, make_plan
from dagrl.dag.spec import GraphError, GraphSpec, load_graph_yaml, validate_graph
from dagrl.registry import Registry
from dagrl.roles.registry import ROLES, Role, import_user_modules


def load_builtin_roles() -> Registry[Role]:
    """The role registry, holding the built-in roles (and any user roles imported so far)."""
    return ROLES


def build_graph(cfg: Config) -> GraphSpec:
    """The configured graph: `dag.graph` (a built-in name or a YAML file), else the built-in
    graph of `algorithm.name`."""
    name = cfg.dag.graph or cfg.algorithm.name
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        return load_graph_yaml(name)
    return BUILTIN_GRAPHS.get(name)(cfg)


def plan_for(cfg: Config, world_size: int) -> tuple[GraphSpec, list[str], list[RankPlan]]:
    """Import user roles, build and validate the graph, and plan it for `world_size` ranks."""
    import_user_modules(cfg.dag.modules)
    graph = build_graph(cfg)
    order = validate_graph(graph, ROLES)
    check_node_models(graph, cfg, world_size)
    trains = frozenset(name for name in ROLES if ROLES.get(name).trains)
    return graph, order, make_plan(graph, order, world_size, trains)


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


def engines_of(plan: RankPlan, model: str = "") -> set[str]:
    """The engines (dagrl.roles.registry.ENGINES names) of policy `model` ('' = the main one)
    that the nodes of one rank's plan use."""
    return {e for t in plan.tasks if t.kind == "node" and t.model == model
            for e in ROLES.get(t.role).engines}
