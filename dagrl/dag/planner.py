"""From a validated graph and the number of workers to one ordered task list per rank.

Every rank runs the same loop over its own list (SPMD). A node task runs a role on this rank's
shard; a reshard task moves samples between ranks when consecutive nodes are placed on
different sets of ranks (a node's `ranks` option; default: all ranks); a balance task, before
a training node on several ranks, re-assigns whole groups so that ranks hold similar token
counts. Reshard and balance tasks are collective, so they appear in every rank's list; a node
task only in the lists of the ranks that host the node.

Two kinds of layout. *Sharded*: each rank of the node's ranks holds its own samples.
*Replicated* over ranks R in groups of g > 1: R forms data-parallel replicas of g consecutive
ranks, and every rank of a replica holds all of the replica's samples (its ranks run one model
together). Two such layouts exist:

- the training layout under tensor or sequence parallelism (`group` = tp x sp): the training
  ranks (`model_ranks`: all of them, or trainer.mode=async's trainer side) in replicas of
  `group`. Nodes on the training ranks whose role runs a training model (`model_roles`) run in
  it (with `group` 1: sharded over the training ranks); nodes of those roles on other ranks run
  sharded (an async rollout side's reference runs its forward sharded: the training mesh is the
  trainer side's);
- the rollout layout under rollout tensor parallelism (`rollout_group` = the rollout engine's
  tp size): the nodes whose role generates with the rollout engine (`rollout_roles`) run on
  replicas of `rollout_group` consecutive ranks of their own ranks, each replica one engine.

Other nodes run in whichever layout the batch is in when their ranks are the layout's (each
rank of a replica then computes the same result), else sharded. Between layouts:

  replicate    sharded -> replicated: whole groups balanced over the replicas (one
               all_to_all), then gathered within each replica (one all-gather); from other
               ranks, a reshard onto the training ranks first
  unreplicate  replicated -> sharded: rank i of a replica keeps the i-th 1/group of its
               groups; no data moves
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from dagrl.dag.spec import GraphError, GraphSpec, NodeSpec

KiB = 1024


@dataclass(frozen=True)
class Task:
    kind: str                      # "node" | "reshard" | "balance" | "replicate" | "unreplicate"
    node_id: str = ""
    role: str = ""
    src: tuple[int, ...] = ()      # reshard: ranks holding the data before
    dst: tuple[int, ...] = ()      # reshard: ranks that must hold it after
    group: int = 1                 # ranks per replica of the layout the task runs in / makes
    samples_in: float = 0.0        # moves: samples a rank receives at most (0: unknown)
    sample_bytes: int = 0          # moves: tensor bytes of one sample at this point
    model: str = ""                # node: the policy it uses ('' = the main one)
    rollout: bool = False          # (un)replicate: of the rollout layout, not the training one

    def describe(self) -> str:
        if self.kind == "node":
            where = f" on {len(self.dst) // self.group} replicas" if self.group > 1 else ""
            model = f" @{self.model}" if self.model else ""
            return f"run {self.node_id} [{self.role}{model}]{where}"
        if self.kind == "balance":
            if self.group > 1:
                text = (f"balance tokens over the {len(self.dst) // self.group} replicas of "
                        f"{self.group} ranks (before {self.node_id})")
            else:
                text = f"balance tokens over {_ranks(self.dst)} (before {self.node_id})"
        elif self.kind == "replicate":
            text = (f"reshard {_ranks(self.src)} -> {self._layout_name}: "
                    f"{len(self.dst) // self.group} replica(s) x {self.group} ranks "
                    f"({'rollout tp' if self.rollout else 'tp x sp'}), "
                    f"groups balanced over replicas, each sample on every rank of its replica "
                    f"(before {self.node_id})")
        elif self.kind == "unreplicate":
            return (f"reshard {self._layout_name} -> {_ranks(self.dst)}: each rank keeps 1/"
                    f"{self.group} of its replica's groups, no data moves (before "
                    f"{self.node_id})")
        else:
            text = f"reshard {_ranks(self.src)} -> {_ranks(self.dst)} (before {self.node_id})"
        return text + self._volume()

    @property
    def _layout_name(self) -> str:
        return "rollout layout" if self.rollout else "training layout"

    def _volume(self) -> str:
        if not self.samples_in or not self.sample_bytes:
            return ""
        total = self.samples_in * self.sample_bytes
        return (f"; <= {self.samples_in:g} samples x {self.sample_bytes} B = "
                f"{total / KiB:.1f} KiB into a rank")


@dataclass(frozen=True)
class RankPlan:
    rank: int
    tasks: tuple[Task, ...]


@dataclass(frozen=True)
class PlanSizes:
    """What `dagrl plan` needs to put byte counts on the moves: global samples and tensor
    bytes per sample as the batch reaches each node (before it runs)."""
    samples: Mapping[str, int]
    sample_bytes: Mapping[str, int]


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
              balance_roles: frozenset[str] = frozenset(), *, group: int = 1,
              model_roles: frozenset[str] = frozenset(),
              model_ranks: tuple[int, ...] | None = None,
              rollout_roles: frozenset[str] = frozenset(), rollout_group: int = 1,
              sizes: PlanSizes | None = None) -> list[RankPlan]:
    """One RankPlan per rank for the nodes in `order` (from `validate_graph`); nodes whose
    role is in `balance_roles` (the training roles) get a balance task when on several ranks
    (replicas). Nodes on `model_ranks` (default: every rank) whose role is in `model_roles` run
    in the training layout of len(model_ranks) / group replicas; nodes whose role is in
    `rollout_roles` in replicas of `rollout_group` of their ranks (module docstring). `sizes`:
    volumes for the moves."""
    everyone = tuple(range(world_size))
    model_ranks = everyone if model_ranks is None else tuple(model_ranks)
    if len(model_ranks) % group:
        raise GraphError(f"the {len(model_ranks)} training ranks do not split into replicas "
                         f"of {group}")
    layout, replicated = everyone, 1       # the prompts start spread over all ranks
    replicated_for_rollout = False
    tasks: list[Task] = []
    for node_id in order:
        node = graph.node(node_id)
        ranks = node_ranks(node, world_size)
        want = _wanted_layout(node, ranks, (layout, replicated), everyone, group, model_roles,
                              model_ranks, rollout_roles, rollout_group)
        if want != (layout, replicated):
            if replicated > 1:
                tasks.append(Task("unreplicate", node_id, node.role, src=layout,
                                  dst=layout, group=replicated, rollout=replicated_for_rollout))
                replicated = 1
            if want[1] > 1 and layout != want[0]:
                tasks.append(Task("reshard", node_id, node.role, src=layout, dst=want[0]))
                layout = want[0]
            if want[1] > 1:
                tasks.append(Task("replicate", node_id, node.role, src=layout, dst=want[0],
                                  group=want[1], rollout=node.role in rollout_roles))
            elif want[0] != layout:
                tasks.append(Task("reshard", node_id, node.role, src=layout, dst=want[0]))
            layout, replicated = want
            replicated_for_rollout = node.role in rollout_roles
        n_parts = len(ranks) // replicated
        # A replicate task balances the replicas as it fills them.
        if node.role in balance_roles and n_parts > 1 and tasks and tasks[-1].kind != "replicate":
            tasks.append(Task("balance", node_id, node.role, src=ranks, dst=ranks,
                              group=replicated))
        tasks.append(Task("node", node_id, node.role, dst=ranks, group=replicated,
                          model=node.model))
    if sizes is not None:
        tasks = [_with_volume(t, sizes, world_size) for t in tasks]
    # Reshards involve every rank; the rest only the ranks of their layout.
    return [RankPlan(r, tuple(t for t in tasks if t.kind == "reshard" or r in t.dst))
            for r in everyone]


def _wanted_layout(node: NodeSpec, ranks: tuple[int, ...], current: tuple[tuple[int, ...], int],
                   everyone: tuple[int, ...], group: int, model_roles: frozenset[str],
                   model_ranks: tuple[int, ...], rollout_roles: frozenset[str],
                   rollout_group: int) -> tuple[tuple[int, ...], int]:
    """The layout (ranks, ranks per replica) a node runs in (module docstring)."""
    if node.role in model_roles and ranks == model_ranks:
        return model_ranks, group
    if group > 1 and node.role in model_roles and model_ranks == everyone:
        raise GraphError(f"node {node.id!r} runs a tensor/sequence-parallel model, so "
                         "it must run on every rank (drop its options.ranks)")
    if node.role in rollout_roles and rollout_group > 1:
        if len(ranks) % rollout_group:
            raise GraphError(f"node {node.id!r} generates with a rollout engine sharded over "
                             f"{rollout_group} ranks (rollout.vllm.tensor_parallel_size), so "
                             f"its {len(ranks)} rank(s) {list(ranks)} must split into replicas "
                             f"of {rollout_group}")
        return ranks, rollout_group
    if current[1] > 1 and ranks == current[0] and node.role not in model_roles:
        return current                       # stays in the replicas: no move
    return ranks, 1


def _with_volume(task: Task, sizes: PlanSizes, world_size: int) -> Task:
    """The most samples one rank receives in a move (balances: at most its whole share)."""
    samples = sizes.samples.get(task.node_id, 0)
    if task.kind == "reshard":
        into = samples / len(task.dst)
    elif task.kind == "balance":
        into = samples / (len(task.dst) // task.group)
    elif task.kind == "replicate":
        # The all-gather brings the other group - 1 ranks' shares of the replica; balancing
        # over several replicas first brings at most a rank's whole share.
        replicas = len(task.dst) // task.group
        into = samples / replicas * (task.group - 1) / task.group
        if replicas > 1:
            into += samples / len(task.dst)
    else:
        return task
    return replace(task, samples_in=into, sample_bytes=sizes.sample_bytes.get(task.node_id, 0))


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
