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
import dagrl.roles.score
import dagrl.roles.update  # noqa: F401
from dagrl.config.schema import Config
from dagrl.dag.async_placement import AsyncSides, place_async
from dagrl.dag.builtin import BUILTIN_GRAPHS
from dagrl.dag.planner import RankPlan, make_plan
from dagrl.dag.spec import GraphSpec, load_graph_yaml, validate_graph
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


# trainer.mode=async: the roles that run on the rollout ranks, and those that follow them there
# when their inputs are made there (dag/async_placement.py): the reference is frozen, so its
# log-probs need no weights from the trainer.
ROLLOUT_SIDE_ROLES = frozenset({"rollout", "greedy_baseline", "reward"})
FOLLOWER_ROLES = frozenset({"ref_logprob"})


def plan_for(cfg: Config, world_size: int) -> tuple[GraphSpec, list[str], list[RankPlan]]:
    """Import user roles, build and validate the graph, and plan it for `world_size` ranks."""
    graph, order, plans, _ = plan_with_sides(cfg, world_size)
    return graph, order, plans


def plan_with_sides(cfg: Config, world_size: int
                    ) -> tuple[GraphSpec, list[str], list[RankPlan], AsyncSides | None]:
    """`plan_for`, and under trainer.mode=async the graph placed on its two sides first (None
    in sync mode)."""
    import_user_modules(cfg.dag.modules)
    graph = build_graph(cfg)
    order = validate_graph(graph, ROLES)
    sides = None
    if cfg.is_async:
        graph, order, sides = place_async(graph, order, world_size, ROLLOUT_SIDE_ROLES,
                                          FOLLOWER_ROLES)
    trains = frozenset(name for name in ROLES if ROLES.get(name).trains)
    return graph, order, make_plan(graph, order, world_size, trains), sides


def engines_of(plan: RankPlan) -> set[str]:
    """The engines (dagrl.roles.registry.ENGINES names) the nodes of one rank's plan use."""
    return {e for t in plan.tasks if t.kind == "node" for e in ROLES.get(t.role).engines}
