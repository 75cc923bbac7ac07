"""From a validated graph and the number of workers to one ordered task list per rank.

Every rank runs the same loop over its own list (SPMD). A node task runs a role on this rank's
shard; a reshard task moves samples between ranks when consecutive nodes are placed on
different sets of ranks (a node's `ranks` option; default: all ranks); a balance task, before
a training node on several ranks, re-assigns whole groups so that ranks hold similar token
counts. Reshard and balance tasks are collective, so they appear in every rank's list; a node
task only in the lists of the ranks that host the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from dagrl.dag.spec import GraphError, GraphSpec, NodeSpec


@dataclass(frozen=True)
class Task:
    kind: str                      # "node" | "reshard" | "balance"
    node_id: str = ""
    role: str = ""
    src: tuple[int, ...] = ()      # reshard: ranks holding the data before
    dst: tuple[int, ...] = ()      # reshard: ranks that must hold it after
    model: str = ""                # node: the policy it uses ('' = the main one)

    def describe(self) -> str:
        if self.kind == "node":
            return f"run {self.node_id} [{self.role}{' @' + self.model if self.model else ''}]"
        if self.kind == "balance":
            return f"balance tokens over {_ranks(self.dst)} (before {self.node_id})"
        return f"reshard {_ranks(self.src)} -> {_ranks(self.dst)} (before {self.node_id})"


@dataclass(frozen=True)
class RankPlan:
    rank: int
    tasks: tuple[Task, ...]


def _ranks(ranks: tuple[int, ...]) -> str:
    return "ranks " + ",".join(map(str, ranks))


def node_ranks(node: NodeSpec, world_size: int) -> tuple[int, ...]:
    """The ranks a node runs on: `options.ranks`, or all of them."""
    ranks = node.options.get("ranks")
    if ranks is None:
        return tuple(range(world_size))
    if (not isinstance(ranks, (list, tuple)) or not ranks
            or not all(isinstance(r, int) and 0 <= r < world_size for r in ranks)
            or len(set(ranks)) != len(ranks)):
        raise GraphError(f"node {node.id!r}: options.ranks must be a non-empty list of distinct "
                         f"ranks in [0, {world_size}), got {ranks!r}")
    return tuple(sorted(ranks))


def make_plan(graph: GraphSpec, order: list[str], world_size: int,
              balance_roles: frozenset[str] = frozenset()) -> list[RankPlan]:
    """One RankPlan per rank for the nodes in `order` (from `validate_graph`); nodes whose
    role is in `balance_roles` (the training roles) get a balance task when on several ranks."""
    everyone = tuple(range(world_size))
    layout = everyone                      # the prompts start spread over all ranks
    tasks: list[Task] = []
    for node_id in order:
        node = graph.node(node_id)
        ranks = node_ranks(node, world_size)
        if ranks != layout:
            tasks.append(Task("reshard", node_id, node.role, src=layout, dst=ranks))
            layout = ranks
        if node.role in balance_roles and len(ranks) > 1:
            tasks.append(Task("balance", node_id, node.role, src=ranks, dst=ranks))
        tasks.append(Task("node", node_id, node.role, dst=ranks, model=node.model))
    # Reshards involve every rank; nodes and balances only the ranks of their layout.
    return [RankPlan(r, tuple(t for t in tasks if t.kind == "reshard" or r in t.dst))
            for r in everyone]


def format_plan(graph: GraphSpec, order: list[str], plans: list[RankPlan]) -> str:
    """Human-readable graph and per-rank task lists (what `dagrl plan` prints)."""
    lines = [f"graph {graph.name}: {len(graph.nodes)} nodes"]
    for node_id in order:
        node = graph.node(node_id)
        deps = ", ".join(node.deps) if node.deps else "-"
        opts = f"  {dict(node.options)}" if node.options else ""
        model = f"  model={node.model}" if node.model else ""
        lines.append(f"  {node.id:<14} role={node.role:<14} deps: {deps}{opts}{model}")
    for plan in plans:
        lines.append(f"rank {plan.rank}:")
        lines.extend(f"  {i}. {task.describe()}" for i, task in enumerate(plan.tasks, 1))
    return "\n".join(lines)
