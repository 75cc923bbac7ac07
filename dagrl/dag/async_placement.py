"""Placement of a graph for trainer.mode=async: the rollout side on one subset of the ranks, the
rest of the graph (the trainer side) on the others.

The rollout side is every node whose role generates or scores (roles declaring side="rollout",
passed in by the roles layer), and every node of a role that reads no trained weights
(side="follower": the frozen reference's `ref_logprob`) whose dependencies are all on the
rollout side — its forward pass then runs where the samples are made, which takes that work off
the trainer ranks (on two workers the trainer side is the slower one). A rollout-side node must
not depend on a trainer-side node, so the two sides can step independently: the rollout ranks
run the rollout side batch after batch and push what it returns into the async buffer; the
trainer ranks pull batches from it and run the trainer side. The planner then sees one reshard,
rollout ranks -> trainer ranks, and that reshard is where the buffer is.

Default placement (a node's `options.ranks` overrides it): with W workers the trainer side gets
ranks [0, ceil(W/2)) and the rollout side the rest — half and half, the trainer the larger half
when W is odd (training costs more FLOPs per sample than generation), and rank 0 trains (it
writes the metrics and commits checkpoints). Every node of a side must run on all of that
side's ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from dagrl.dag.planner import node_ranks
from dagrl.dag.spec import GraphError, GraphSpec


@dataclass(frozen=True)
class AsyncSides:
    rollout_ranks: tuple[int, ...]
    trainer_ranks: tuple[int, ...]
    rollout_nodes: tuple[str, ...]     # in execution order
    trainer_nodes: tuple[str, ...]


def default_trainer_ranks(world_size: int) -> tuple[int, ...]:
    return tuple(range(-(-world_size // 2)))


def place_async(graph: GraphSpec, order: list[str], world_size: int,
                rollout_roles: Collection[str], follower_roles: Collection[str] = (),
                refusals: Mapping[str, str] | None = None
                ) -> tuple[GraphSpec, list[str], AsyncSides]:
    """The graph with every node's `options.ranks` set (its own, or its side's default), the
    execution order with the rollout side first, and the two sides. A node of a role in
    `follower_roles` joins the rollout side when all its dependencies are there (and its own
    `options.ranks`, if set, are not the trainer side's); else the trainer side. `refusals`:
    role -> why it cannot run in async mode (the roles declare it). Errors name the node."""
    refusals = refusals or {}
    if world_size < 2:
        raise GraphError("trainer.mode=async needs at least 2 workers")
    for node_id in order:
        role = graph.node(node_id).role
        if refusals.get(role):
            raise GraphError(f"node {node_id!r}: role {role!r} is not supported in "
                             f"trainer.mode=async ({refusals[role]})")
    rollout = [n for n in order if graph.node(n).role in rollout_roles]
    explicit = [node_ranks(graph.node(n), world_size) for n in rollout
                if graph.node(n).options.get("ranks") is not None]
    trainer_default = default_trainer_ranks(world_size)
    rollout_ranks = explicit[0] if explicit else tuple(
        r for r in range(world_size) if r not in trainer_default)
    for node_id in order:   # in execution order: a follower's dependencies are placed already
        node = graph.node(node_id)
        pinned = node.options.get("ranks")
        if (rollout and node.role in follower_roles and node_id not in rollout
                and all(d in rollout for d in node.deps)
                and (pinned is None or node_ranks(node, world_size) == rollout_ranks)):
            rollout.append(node_id)
    rollout = [n for n in order if n in rollout]
    trainer = [n for n in order if n not in rollout]
    if not rollout or not trainer:
        raise GraphError(f"graph {graph.name!r}: trainer.mode=async needs a rollout side (roles "
                         f"{sorted(rollout_roles)}) and a trainer side; found "
                         f"{'no rollout node' if not rollout else 'only rollout-side nodes'}")
    for node_id in rollout:
        late = [d for d in graph.node(node_id).deps if d in trainer]
        if late:
            raise GraphError(f"node {node_id!r} runs on the rollout side in trainer.mode=async "
                             f"but depends on trainer-side node(s) {late}")
    trainer_ranks = tuple(r for r in range(world_size) if r not in rollout_ranks)
    if not trainer_ranks:
        raise GraphError(f"trainer.mode=async: the rollout side is placed on every rank "
                         f"{list(rollout_ranks)}; leave some for training")
    placed = {}
    for side, ranks in ((rollout, rollout_ranks), (trainer, trainer_ranks)):
        for node_id in side:
            node = graph.node(node_id)
            if node.options.get("ranks") is not None and node_ranks(node, world_size) != ranks:
                which = "rollout" if side is rollout else "trainer"
                raise GraphError(f"node {node_id!r}: options.ranks {list(node.options['ranks'])} "
                                 f"in trainer.mode=async must be the {which} side's ranks "
                                 f"{list(ranks)} (every node of a side runs on all its ranks)")
            placed[node_id] = dataclasses.replace(
                node, options={**node.options, "ranks": list(ranks)})
    new_graph = GraphSpec(graph.name, tuple(placed[n.id] for n in graph.nodes))
    sides = AsyncSides(rollout_ranks, trainer_ranks, tuple(rollout), tuple(trainer))
    return new_graph, rollout + trainer, sides
