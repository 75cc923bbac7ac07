"""An RL algorithm as a graph: nodes with a role, dependencies and options.

Written in YAML:

    name: my_grpo
    nodes:
      - {id: rollout, role: rollout}
      - {id: reward, role: reward, deps: [rollout]}
      - {id: adv, role: advantage, deps: [reward]}
      - {id: update, role: actor_update, deps: [adv]}

A node may name the policy it uses (`model: refiner`, one of the config's `models`; see
dagrl/config/models.py); without it, the main policy.

`use:` in place of a role stands for what the policy's config picks, as the built-in graphs
have it (dag/builtin.py), so a hand-written graph runs whichever reward source and algorithm
the config names: `use: reward` is the node that scores (reward.source: rule scorers, a reward
model or a judge), `use: algorithm` the training nodes of the configured algorithm after the
reward (DAPO's filter, old_logprob, ref_logprob, PPO's values, kl_penalty, advantage,
actor_update, critic_update):

      - {id: reward, use: reward, deps: [rollout]}
      - {id: train, use: algorithm, deps: [reward]}
      - {id: refiner_train, use: algorithm, model: refiner, deps: [refiner_reward]}

or built in Python with `GraphSpec(name, [NodeSpec(...), ...])`. `validate_graph` checks it and
returns the execution order; its errors name the nodes at fault.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dagrl.registry import Registry


class GraphError(ValueError):
    """An invalid graph: the message names the nodes involved."""


@dataclass(frozen=True)
class NodeSpec:
    id: str
    role: str
    deps: tuple[str, ...] = ()
    # Role-specific settings, plus placement: `ranks: [0, 1]` runs the node on a subset of the
    # workers (the data is moved there and back by the planner's reshard tasks).
    options: Mapping[str, Any] = field(default_factory=dict)
    # Which policy the node uses: '' the main one, else a name from the config's `models`.
    model: str = ""


@dataclass(frozen=True)
class GraphSpec:
    name: str
    nodes: tuple[NodeSpec, ...]

    def node(self, node_id: str) -> NodeSpec:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    @property
    def roles(self) -> set[str]:
        return {n.role for n in self.nodes}


_NODE_KEYS = {"id", "role", "deps", "options", "model"}
# The role of a `use: algorithm` / `use: reward` node until the planner expands it
# (dag/builtin.py).
USE_ALGORITHM = "use: algorithm"
USE_REWARD = "use: reward"
USES = {"algorithm": USE_ALGORITHM, "reward": USE_REWARD}


def graph_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> GraphSpec:
    """Build a GraphSpec from its YAML/dict form; structural errors name `source` and the node."""
    if not isinstance(data, Mapping) or "nodes" not in data:
        raise GraphError(f"{source}: a graph is a mapping with a 'nodes' list")
    unknown = set(data) - {"name", "nodes"}
    if unknown:
        raise GraphError(f"{source}: unknown graph key(s) {sorted(unknown)} (allowed: name, nodes)")
    nodes = []
    for i, raw in enumerate(data["nodes"] or []):
        if not isinstance(raw, Mapping) or "id" not in raw or ("role" in raw) == ("use" in raw):
            raise GraphError(f"{source}: node #{i} must be a mapping with 'id' and one of "
                             "'role' or 'use' (algorithm, reward)")
        if "use" in raw and raw["use"] not in USES:
            raise GraphError(f"{source}: node {raw['id']!r}: use must be one of "
                             f"{', '.join(USES)}, got {raw['use']!r}")
        role = str(raw["role"]) if "role" in raw else USES[raw["use"]]
        extra = set(raw) - _NODE_KEYS - {"use"}
        if extra:
            raise GraphError(f"{source}: node {raw['id']!r} has unknown key(s) {sorted(extra)} "
                             f"(allowed: {', '.join(sorted(_NODE_KEYS | {'use'}))})")
        deps = raw.get("deps") or []
        if isinstance(deps, str):
            deps = [deps]
        nodes.append(NodeSpec(str(raw["id"]), role, tuple(str(d) for d in deps),
                              dict(raw.get("options") or {}), str(raw.get("model") or "")))
    return GraphSpec(str(data.get("name", Path(source).stem)), tuple(nodes))


def load_graph_yaml(path: str | Path) -> GraphSpec:
    path = Path(path)
    if not path.is_file():
        raise GraphError(f"dag.graph: no such file {str(path)!r}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise GraphError(f"{path}: invalid YAML ({err})") from err
    return graph_from_dict(data, str(path))


def validate_graph(graph: GraphSpec, roles: Registry | Iterable[str]) -> list[str]:
    """Check the graph and return its node ids in execution order.

    Errors: no nodes; duplicate ids; a dependency on a node that does not exist; a role that is
    not registered; a cycle (the message lists the nodes on it, in order).
    """
    if not graph.nodes:
        raise GraphError(f"graph {graph.name!r} has no nodes")
    ids = [n.id for n in graph.nodes]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise GraphError(f"graph {graph.name!r}: duplicate node id(s) {dups}")
    known = set(ids)
    for n in graph.nodes:
        missing = [d for d in n.deps if d not in known]
        if missing:
            raise GraphError(f"graph {graph.name!r}: node {n.id!r} depends on unknown node(s) "
                             f"{missing} (nodes: {', '.join(ids)})")
    for n in graph.nodes:
        if n.role not in roles:
            hint = roles.unknown_message(n.role) if isinstance(roles, Registry) else ""
            what = hint or f"unknown role {n.role!r}"
            raise GraphError(f"graph {graph.name!r}: node {n.id!r} has an {what}")
    return topological_order(graph)


def topological_order(graph: GraphSpec) -> list[str]:
    """Kahn's algorithm; ties keep declaration order, so a plan is deterministic."""
    indegree = {n.id: len(set(n.deps)) for n in graph.nodes}
    children: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    for n in graph.nodes:
        for d in set(n.deps):
            children[d].append(n.id)
    position = {n.id: i for i, n in enumerate(graph.nodes)}
    ready = sorted((i for i, d in indegree.items() if d == 0), key=position.get)
    order: list[str] = []
    while ready:
        node = ready.pop(0)
        order.append(node)
        for child in children[node]:
            indegree[child] -= 1
            if indegree[child] == 0:
                ready.append(child)
        ready.sort(key=position.get)
    if len(order) < len(graph.nodes):
        cycle = _find_cycle(graph, {i for i, d in indegree.items() if d > 0})
        raise GraphError(f"graph {graph.name!r} has a cycle: {' -> '.join(cycle)}")
    return order


def _find_cycle(graph: GraphSpec, candidates: set[str]) -> list[str]:
    """One cycle among the nodes Kahn's algorithm could not order, as [a, b, ..., a]."""
    deps = {n.id: [d for d in n.deps if d in candidates] for n in graph.nodes if n.id in candidates}
    start = min(candidates, key=[n.id for n in graph.nodes].index)
    path, seen = [start], {start: 0}
    node = start
    while True:   # every remaining node has a remaining dependency, so this walk must loop
        node = deps[node][0]
        if node in seen:
            cycle = path[seen[node]:] + [node]
            return list(reversed(cycle))   # reversed: follow the data flow, dep -> dependent
        seen[node] = len(path)
        path.append(node)
