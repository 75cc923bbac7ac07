"""The role registry: what a DAG node of a given role *does*, and what it may use.

A role is a function `fn(ctx: NodeContext, batch: Batch) -> Batch` plus the engines (models)
the worker must build for it. Built-in roles live beside this file (one module per concern,
listed in `roles/plan.py`); a user adds one from their own module (listed in `dag.modules`)
without touching the worker:

    from dagrl import register_role

    @register_role("length_penalty", engines=())
    def length_penalty(ctx, batch):
        batch["scores"] = batch["scores"] - 0.01 * batch["response_mask"].sum(-1)
        return batch
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dagrl.registry import Registry

if TYPE_CHECKING:   # `from dagrl import register_role` stays light: no torch, no model code
    import torch

    from dagrl.config.schema import Config
    from dagrl.dag.spec import NodeSpec
    from dagrl.data.batch import Batch
    from dagrl.engines.bundle import Engines
    from dagrl.observe.metrics import StepMetrics

# Engines a role may ask for; the worker builds the union over the nodes it runs.
ENGINES = ("actor", "critic", "ref", "rollout", "reward", "reward_model", "judge")


@dataclass(frozen=True)
class Role:
    name: str
    fn: Callable
    engines: tuple[str, ...] = ()
    # A training node: with several workers the planner rebalances tokens across ranks first.
    trains: bool = False
    # Runs the actor / reference / critic model: under tensor or sequence parallelism the
    # planner moves the batch into the replicated training layout first (dag/planner.py).
    runs_model: bool = False
    # Per-sample tensor fields the role adds, name -> "[P|R] dtype" (P: prompt width, R:
    # response width, nothing: one value): what `dagrl plan` counts in the bytes of a move.
    adds: Mapping[str, str] = field(default_factory=dict)
    # Where it runs in trainer.mode=async (dag/async_placement.py): "rollout" (it generates or
    # scores: where samples are made), "follower" (it reads no trained weights, so it joins
    # the rollout side when its inputs are all made there), or "trainer".
    side: str = "trainer"
    # Each input row becomes rollout.n samples (the rollout node): the planner's sizes.
    fans_out: bool = False
    # Why it cannot run in trainer.mode=async ("": it can), said by the placement's error.
    async_refusal: str = ""


SIDES = ("rollout", "follower", "trainer")

ROLES: Registry[Role] = Registry("DAG role")


def register_role(name: str, *, engines: Sequence[str] = (), trains: bool = False,
                  runs_model: bool | None = None, adds: Mapping[str, str] | None = None,
                  side: str = "trainer", fans_out: bool = False,
                  async_refusal: str = "") -> Callable:
    """Decorator registering `fn(ctx, batch) -> batch` as the role `name`. `runs_model`
    (default: `trains`): the node runs the actor / reference / critic model, so under
    tensor or sequence parallelism every rank of a replica must hold its samples. `adds`: the
    per-sample tensor fields it adds; `side`, `fans_out`, `async_refusal`: see `Role`."""
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise ValueError(f"role {name!r} asks for unknown engine(s) {bad}; known: {ENGINES}")
    if side not in SIDES:
        raise ValueError(f"role {name!r}: side {side!r} is not one of {SIDES}")

    def decorator(fn: Callable) -> Callable:
        ROLES.add(name, Role(name, fn, tuple(engines), trains,
                             trains if runs_model is None else runs_model, dict(adds or {}),
                             side, fans_out, async_refusal))
        return fn

    return decorator


@dataclass
class NodeContext:
    """What a node function may use: the config, its node, the step, this worker's engines and
    the step's metrics."""
    config: Config
    node: NodeSpec
    step: int
    rank: int
    world_size: int
    engines: Engines
    metrics: StepMetrics
    # Sums a tensor over the ranks running this node (identity on one rank): global statistics
    # (whitening, KL, counts) come from reduced sums, never from moving the batch.
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    # Runs the nodes before this one again on fresh prompts (DAPO's dynamic sampling).
    more: Callable[[], Batch] | None = None
    # The next step's prompts when they may be generated now, else None (the async rollout
    # side: runtime/streams.py); None where the next step needs this one's update first.
    next_prompts: Callable[[], Batch | None] | None = None
    # The engines of the config's extra `models`, by name (roles/multi_model.py): what a
    # node of the main policy needs to hand data to another model.
    model_engines: Mapping[str, Engines] = field(default_factory=dict)


def import_user_modules(modules: Sequence[str]) -> None:
    """Import `dag.modules` entries: dotted module names or paths to .py files."""
    for spec in modules:
        if spec.endswith(".py"):
            path = Path(spec).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"dag.modules: no such file {spec!r}")
            name = f"dagrl_user_{abs(hash(str(path)))}"
            if name in sys.modules:
                continue
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        else:
            importlib.import_module(spec)
