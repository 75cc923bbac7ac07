"""The composition matrix (docs/composition.md): dagrl's features as factors and levels, which
pairs of them the components refuse, and a pairwise covering array of runs over the rest.

A *level* is one way to turn a feature on: the `a.b=c` overrides `dagrl train` takes. Mutually
exclusive choices are the levels of one *factor* (the rollout backend, the launcher, the reward
source, the algorithm, the multi-turn kind); every other feature is a factor with one level
(on; off is no level). A *pair* is two levels of two different factors.

Nothing here lists what is refused. A pair (or a run) is refused when the components refuse it:
the config loader (`dagrl train`'s, presets and registered names included), the planner
(`plan_with_sides`), the rollout backend's own check (`rollout_backend`), the launcher's
pre-flight (`check_inputs`) and the engine layouts each worker computes before it builds
anything (`EngineLayout.of`, one per async side and per extra policy). Their message is the
physical reason recorded in the doc; as refusals are lifted the matrix follows on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from tests.vllm_helpers import SMALL_ENGINE

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "composition.md"
SEED = 0
# The greedy covering array's search, for each run it keeps (AETG-style): the first uncovered
# pair and STARTS - 1 random others, CANDIDATES random growths from each.
STARTS = 4
CANDIDATES = 4
HARD_WEIGHT = 100

# Every run: 3 steps of the tiny default task, small batches (divisible by 4 workers).
COMMON = ("logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
          "trainer.total_steps=3", "data.train_batch_size=8", "actor.mini_batch_size=8",
          "rollout.n=4", "rollout.max_new_tokens=6")
def last_given(overrides: list[str]) -> list[str]:
    """One override per key, the last given: the levels refine COMMON's defaults (dagrl itself
    refuses a key given twice)."""
    by_key: dict[str, str] = {}
    for item in overrides:
        by_key[item.partition("=")[0]] = item
    return list(by_key.values())


# The default tiny model's 2 query heads split over tp or sp, not over both (tp x sp = 4 ranks
# per head group): a run with both trains a 4-head model, and so does its 1-worker reference.
# Hidden 128 keeps the head size at 32, the smallest vLLM's CPU attention runs.
WIDE_FACTORS = frozenset({"tp", "sp"})
WIDE_MODEL = ("model.tiny_hidden_size=128", "model.tiny_heads=4")
# World sizes a run may have; a run gets the smallest its levels allow and the components accept.
WORLD_SIZES = (1, 2, 4, 8)
# The parity check's tolerance where a run's levels declare none: the tensor/sequence-parallel
# runs' (tests/test_model_parallel_runs.py).
EXACT = 1e-5


@dataclass(frozen=True)
class Level:
    """One way to turn a feature on.

    kind: `semantic` changes what a step computes; `layout` only changes where and how it is
    computed, so a run must reproduce the 1-worker run of its other levels; `observer` adds
    records and files and is kept in that 1-worker run too (it validates or profiles what its
    run computes); `launcher` says how the workers start.
    """
    factor: str
    name: str
    overrides: tuple[str, ...] = ()
    kind: str = "semantic"
    # World sizes: at least this many workers (HSDP's shard groups need 4 to be HSDP at all).
    min_workers: int = 1
    # The world sizes a launcher starts (None: any of WORLD_SIZES).
    worlds: tuple[int, ...] | None = None
    # Relative tolerance of the parity check against 1 worker (the loosest in a run applies),
    # as the existing parity tests use for this layout.
    rel: float = EXACT
    # Metric-key prefixes (or `file:` paths under the run directory) a run with this level
    # must show: evidence that the feature really was on.
    evidence: tuple[str, ...] = ()
    # Needs vLLM (its own venv, pytest -m vllm).
    vllm: bool = False
    # Seconds it adds to a run per worker (measured here): the covering array's cost model.
    cost: float = 0.0
    # A feature of the matrix, paired with the others. False: the 1-worker baseline every
    # layout run is checked against (its pairs are not features' pairs; see HEADER).
    paired: bool = True

    @property
    def key(self) -> str:
        return self.name if self.name == self.factor else f"{self.factor}={self.name}"


MULTI_TURN_COMMON = ("rollout.multi_turn.enable=true", "rollout.multi_turn.format=tiny")
# examples/two_policies.yaml: its graph has no reference model, hence no KL loss.
TWO_POLICIES = (f"dag.graph={ROOT / 'examples' / 'two_policies.graph.yaml'}",
                "models.refiner.model.path=builtin:tiny-llama",
                "models.refiner.rollout.max_new_tokens=6", "algorithm.kl_loss_coef=0")
# The server level's URL: a `vllm serve` of the policy's tiny model, started by the test.
SERVER_URL = "{server_url}"
VLLM_ENGINE = tuple(SMALL_ENGINE)

FACTORS: dict[str, tuple[Level, ...]] = {
    "backend": (
        Level("backend", "native", ("rollout.backend=native",)),
        Level("backend", "hf", ("rollout.backend=hf",)),
        # One vLLM engine per worker, ~10 s to start each (the first in a process: ~15 s).
        Level("backend", "vllm", ("rollout.backend=vllm", *VLLM_ENGINE), vllm=True, rel=1e-3,
              cost=10.0),
        Level("backend", "server", ("rollout.backend=server",
                                    f"rollout.server.urls=[{SERVER_URL}]",
                                    "rollout.server.frozen_policy=true"), vllm=True),
    ),
    "launcher": (
        # One worker in the test's process: the baseline of the parity checks, not a feature
        # (the list has 2 workers under Ray and under torchrun); it is not paired.
        Level("launcher", "in-process", kind="launcher", worlds=(1,), paired=False),
        # 2 workers (4 where a level needs them); the runtime parity tests' tolerance
        # (tests/test_runtime.py, tests/test_hsdp.py, tests/test_offload.py).
        Level("launcher", "ray", kind="launcher", worlds=(2, 4, 8), rel=1e-4),
        Level("launcher", "torchrun", kind="launcher", worlds=(2, 4, 8), rel=1e-4),
    ),
    "reward": (
        Level("reward", "rule", ("reward.source=rule",)),
        Level("reward", "reward_model", ("reward.source=reward_model",
                                         "reward_model.path=builtin:tiny-digit-rm")),
        Level("reward", "judge", ("reward.source=judge", "judge.path=builtin:tiny-qwen2",
                                  "judge.backend=hf", "judge.template=q {prompt} a {response}",
                                  r"judge.score_pattern=(\d)", "judge.max_new_tokens=4",
                                  "judge.score_scale=9"), evidence=("judge/",)),
    ),
    "algorithm": (
        Level("algorithm", "grpo", ("algorithm.name=grpo",)),
        Level("algorithm", "dapo", ("algorithm.name=dapo",), evidence=("filter/",)),
        Level("algorithm", "ppo", ("algorithm.name=ppo",), evidence=("critic/vf_loss",)),
    ),
    "multi_turn": (
        # On the default `a+b=` task (a turn ending in `=` calls the calculator): its rule
        # rewards vary from the first step, which DAPO's filter needs (examples/tool_calc.yaml's
        # task scores 0 for every sample until the policy has learned to call the tool).
        Level("multi_turn", "tools", (*MULTI_TURN_COMMON, "rollout.multi_turn.tools=[calculator]",
                                      "rollout.max_new_tokens=16",
                                      "rollout.multi_turn.max_turns=3",
                                      "rollout.multi_turn.max_tokens_per_turn=6"),
              evidence=("tools/calls_mean",)),
        # Room for 3 turns (the environment's answers count in the 32 tokens), so episodes
        # differ in length and reward; prompt + response within test_vllm's server's 128 tokens.
        Level("multi_turn", "env", (*MULTI_TURN_COMMON,
                                    "rollout.multi_turn.environment=guess_number",
                                    "data.train_files=[builtin:guess-number]",
                                    "data.max_prompt_length=32", "rollout.max_new_tokens=32",
                                    "rollout.multi_turn.max_turns=3",
                                    "rollout.multi_turn.max_tokens_per_turn=3"),
              evidence=("multi_turn/turns_mean",)),
    ),
    # On/off features: one level each. Async with max_staleness=0 and no partial rollout trains
    # on the sync run's batches (docs/async.md): a layout.
    "async": (Level("async", "async", ("trainer.mode=async", "rollout.max_staleness=0"),
                    kind="layout", min_workers=2, rel=1e-4, evidence=("async/staleness_max",)),),
    "lora": (Level("lora", "lora", ("actor.lora.rank=8",)),),
    "tp": (Level("tp", "tp", ("actor.tensor_parallel_size=2",), kind="layout", min_workers=2),),
    "sp": (Level("sp", "sp", ("actor.sequence_parallel_size=2",), kind="layout", min_workers=2),),
    # Two shard groups of two: with 2 workers a shard size of 2 is plain FSDP2.
    "hsdp": (Level("hsdp", "hsdp", ("trainer.fsdp_shard_size=2",), kind="layout",
                   min_workers=4, rel=1e-4),),
    "offload": (Level("offload", "offload", ("actor.offload=true",), kind="layout",
                      min_workers=2, rel=1e-4),),
    "models": (Level("models", "models", TWO_POLICIES, evidence=("refiner/actor/pg_loss",)),),
    "validation": (Level("validation", "validation", ("data.val_files=[builtin:arith]",
                                                      "trainer.val_every=3"),
                         kind="observer", evidence=("val/",)),),
    "profiler": (Level("profiler", "profiler", ("profiler.enable=true",), kind="observer",
                       evidence=("file:profile/trace.json",)),),
}
# A factor whose first level every run has unless it picks another (a run has one backend,
# launcher, reward source and algorithm); the others may be off.
REQUIRED = ("backend", "launcher", "reward", "algorithm")
LEVELS: tuple[Level, ...] = tuple(lv for levels in FACTORS.values() for lv in levels)
PAIRED: tuple[Level, ...] = tuple(lv for lv in LEVELS if lv.paired)
BY_KEY = {lv.key: lv for lv in LEVELS}


def default_levels() -> dict[str, Level]:
    return {f: FACTORS[f][0] for f in REQUIRED}


@dataclass(frozen=True)
class Combination:
    """A set of levels, at most one per factor, with each required factor's default filled in.
    `wide`: the run trains the 4-head tiny model (WIDE_MODEL)."""
    levels: tuple[Level, ...]
    wide: bool = False

    @classmethod
    def of(cls, levels: Iterable[Level]) -> Combination:
        chosen = default_levels()
        for lv in levels:
            chosen[lv.factor] = lv
        order = {f: i for i, f in enumerate(FACTORS)}
        return cls(tuple(sorted(chosen.values(), key=lambda lv: order[lv.factor])),
                   wide=chosen.keys() >= WIDE_FACTORS)

    @property
    def launcher(self) -> Level:
        return next(lv for lv in self.levels if lv.factor == "launcher")

    @property
    def vllm(self) -> bool:
        return any(lv.vllm for lv in self.levels)

    def worlds(self) -> tuple[int, ...]:
        """The world sizes to ask the components about, smallest first: the launcher's, at
        least every level's minimum (none: the launcher's largest, to hear why not)."""
        sizes = self.launcher.worlds or WORLD_SIZES
        need = max(lv.min_workers for lv in self.levels)
        return tuple(w for w in sizes if w >= need) or (max(sizes),)

    def enough_workers(self) -> bool:
        """Whether the launcher starts as many workers as the levels need."""
        sizes = self.launcher.worlds or WORLD_SIZES
        return max(sizes) >= max(lv.min_workers for lv in self.levels)

    def overrides(self, world: int, resources: dict[str, str] | None = None) -> list[str]:
        out = [*COMMON, *(WIDE_MODEL if self.wide else ()),
               *(o for lv in self.levels for o in lv.overrides), f"trainer.n_workers={world}"]
        for name, value in (resources or {}).items():   # str.replace: the judge's template
            out = [o.replace("{" + name + "}", value) for o in out]   # has {prompt} of its own
        return last_given(out)

    def without_layouts(self) -> Combination:
        """The same levels without the layouts and launcher: what 1 worker in this process
        must compute alike (on the same model)."""
        levels = (lv for lv in self.levels if lv.kind in ("semantic", "observer"))
        return dataclasses.replace(Combination.of(levels), wide=self.wide)

    def rel(self) -> float:
        return max(lv.rel for lv in self.levels)

    @property
    def label(self) -> str:
        return " ".join(lv.key for lv in self.levels) + (" (4-head model)" if self.wide else "")


# A run's seconds by launcher and world size, before its levels' own costs (measured on this
# machine: 2 cores, 3 steps of the tiny task).
COST_S = {("in-process", 1): 2.0, ("ray", 2): 27.0, ("ray", 4): 35.0, ("ray", 8): 90.0,
          ("torchrun", 2): 22.0, ("torchrun", 4): 35.0, ("torchrun", 8): 75.0}


# --- asking the components -------------------------------------------------------------------

# Resources the overrides name, as the refusal checks see them (no server is contacted).
CHECK_RESOURCES = {"server_url": "http://127.0.0.1:9"}


def components_refusal(overrides: Sequence[str], world: int) -> str | None:
    """Run the checks a launch runs before any model loads; None if all pass, else the first
    refusal's message. Anything else a check raises is a bug and propagates."""
    from dagrl.config.loader import ConfigError
    from dagrl.dag.spec import GraphError
    from dagrl.registry import UnknownNameError
    from dagrl.roles.plan import plan_with_sides
    from dagrl.rollout import rollout_backend
    from dagrl.runtime.input_checks import check_inputs
    from dagrl.train import load_cli_config

    try:
        cfg = load_cli_config(list(overrides))
        _, _, _, sides = plan_with_sides(cfg, world)
        rollout_backend(cfg)
        check_inputs(cfg)
        check_layouts(cfg, world, sides)
    except (ConfigError, GraphError, UnknownNameError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


@cache
def _refusal(overrides: tuple[str, ...], world: int) -> str | None:
    # Ray and torchrun runs of the same levels have the same overrides: asked once.
    return components_refusal(overrides, world)


def check_layouts(cfg, world: int, sides) -> None:
    """The engine layouts the workers compute before building (runtime/worker.py): one per
    async side, or the sync one; and each extra policy's (engines/bundle.py)."""
    from dagrl.config.models import model_config
    from dagrl.engines.layout import EngineLayout

    if sides is None:
        EngineLayout.of(cfg, world)
    else:
        EngineLayout.of(cfg, world, side_ranks=sides.trainer_ranks, side="trainer")
        EngineLayout.of(cfg, world, side_ranks=sides.rollout_ranks, side="rollout")
    for name in cfg.models:
        EngineLayout.of(model_config(cfg, name), world)


@cache
def accepted_world(combo: Combination) -> tuple[int | None, str | None]:
    """(the smallest world size at which the components accept `combo`, None) or
    (None, the refusal at the largest world size tried: the deeper reason, past any "too few
    workers")."""
    why = None
    for world in combo.worlds():
        why = _refusal(tuple(combo.overrides(world, CHECK_RESOURCES)), world)
        if why is None:
            return world, None
    return None, why


# --- pairs and the covering array ------------------------------------------------------------

Pair = tuple[Level, Level]


def all_pairs() -> list[Pair]:
    """Every pair of paired levels of two different factors, in declaration order."""
    return [(a, b) for a, b in itertools.combinations(PAIRED, 2) if a.factor != b.factor]


def pair_refusal(pair: Pair) -> str | None:
    """None if some launcher runs the pair (every other required factor at its default), else
    the components' message: from the first launcher that starts enough workers for it."""
    launchers = [lv for lv in pair if lv.factor == "launcher"] or FACTORS["launcher"]
    messages = []
    for launcher in launchers:
        combo = Combination.of([*pair, launcher])
        world, why = accepted_world(combo)
        if world is not None:
            return None
        messages.append((not combo.enough_workers(), why))
    return min(messages, key=lambda m: m[0])[1]


def pair_refusals(pairs: Sequence[Pair]) -> dict[Pair, str]:
    """The refused pairs, each with the components' message."""
    out = {}
    for pair in pairs:
        why = pair_refusal(pair)
        if why is not None:
            out[pair] = why
    return out


@dataclass
class Run:
    """One run of the covering array: its levels, world size, the pairs it is the first to
    cover, and the index of its 1-worker reference run (None: it is 1 worker with only semantic
    levels, or none is accepted)."""
    index: int
    combo: Combination
    world: int
    covers: set[Pair] = field(default_factory=set)
    reference: int | None = None


def _pairs_of(levels: Iterable[Level]) -> set[Pair]:
    rank = {lv: i for i, lv in enumerate(LEVELS)}
    ordered = sorted((lv for lv in levels if lv.paired), key=rank.__getitem__)
    return {(a, b) for a, b in itertools.combinations(ordered, 2) if a.factor != b.factor}


def completion(chosen: Iterable[Level]) -> Combination | None:
    """`chosen` with the required factors it lacks: their defaults, and the first launcher with
    which the components accept it (None: no launcher)."""
    chosen = list(chosen)
    launchers = [[]] if any(lv.factor == "launcher" for lv in chosen) else \
        [[lv] for lv in FACTORS["launcher"]]
    for launcher in launchers:
        combo = Combination.of([*chosen, *launcher])
        if accepted_world(combo)[0] is not None:
            return combo
    return None


def _grow(start: Pair, uncovered: set[Pair], hard: set[Pair], refused: set[Pair],
          rng: random.Random) -> Combination | None:
    """A run around `start`: factors in a random order, each given the level (or none) that
    covers the most uncovered pairs with the levels so far and refuses none of them as a pair.
    Then asked of the components as a whole: while they refuse it (a refusal of 3+ levels), the
    level added last is dropped. None: `start` itself cannot be completed."""
    chosen: list[Level] = list(start)
    factors = [f for f in FACTORS if f not in {lv.factor for lv in start}]
    rng.shuffle(factors)
    for factor in factors:
        options = []
        for lv in FACTORS[factor]:
            new = _pairs_of([*chosen, lv]) - _pairs_of(chosen)
            if not new & refused and new & uncovered:
                options.append((-_weight(new, uncovered, hard), rng.random(), lv))
        if options:
            chosen.append(min(options)[2])
    while (combo := completion(chosen)) is None and len(chosen) > len(start):
        chosen.pop()
    return combo


def reference_of(combo: Combination) -> Combination | None:
    """The 1-worker in-process run `combo` must reproduce: its semantic levels alone. None when
    `combo` is that run already, or when the components refuse it."""
    if not needs_reference(combo):
        return None
    ref = combo.without_layouts()
    return ref if accepted_world(ref)[0] is not None else None


def needs_reference(combo: Combination) -> bool:
    """Whether `combo` has layouts (several workers, ...) to check against 1 worker."""
    return any(lv.kind == "layout" or lv.kind == "launcher" and lv.name != "in-process"
               for lv in combo.levels)


def cost(combo: Combination) -> float:
    """The estimated seconds of a run (measured on this machine, idle; see COST_S)."""
    world = accepted_world(combo)[0] or 1
    return COST_S[(combo.launcher.name, world)] + world * sum(lv.cost for lv in combo.levels)


def needs_workers(pair: Pair) -> bool:
    """Whether only a run of several workers can hold `pair` (the components refuse it in
    this process)."""
    combo = Combination.of([*pair, FACTORS["launcher"][0]])
    return not set(pair) <= set(combo.levels) or accepted_world(combo)[0] is None


def covering_runs(allowed: Sequence[Pair], refused: Iterable[Pair]) -> list[Run]:
    """Greedy pairwise covering array. Each step grows CANDIDATES runs from each of STARTS
    uncovered pairs and keeps the one that covers the most uncovered pairs per estimated
    second, its 1-worker reference run counted with it (a reference covers pairs too: it is a
    run of the array). Pairs only several workers can hold weigh HARD_WEIGHT times more: they
    are packed into as few of those runs, the slow ones, as possible. Every run is accepted by
    the components; every allowed pair is in one."""
    rng = random.Random(SEED)
    uncovered, refused = set(allowed), set(refused)
    hard = {p for p in allowed if needs_workers(p)}
    order = {p: (p not in hard, i) for i, p in enumerate(allowed)}   # hard pairs start first
    runs: dict[Combination, Run] = {}
    while uncovered:
        pending = sorted(uncovered, key=order.__getitem__)
        starts = [pending[0], *rng.sample(pending[1:], min(STARTS - 1, len(pending) - 1))]
        best = None
        for start in [s for s in starts for _ in range(CANDIDATES)]:
            combo = _grow(start, uncovered, hard, refused, rng)
            if combo is None:
                continue
            ref = reference_of(combo)
            group = [c for c in (ref, combo) if c is not None and c not in runs]
            covered = set().union(*(_pairs_of(c.levels) for c in group))
            score = _weight(covered, uncovered, hard) / sum(cost(c) for c in group)
            if best is None or score > best[0]:
                best = (score, group)
        assert best is not None, f"no run the components accept has the pair {pending[0]}"
        for combo in best[1]:
            covers = _pairs_of(combo.levels) & uncovered
            uncovered -= covers
            ref = reference_of(combo)
            runs[combo] = Run(len(runs) + 1, combo, accepted_world(combo)[0], covers,
                              runs[ref].index if ref is not None else None)
    return list(runs.values())


def _weight(pairs: set[Pair], uncovered: set[Pair], hard: set[Pair]) -> float:
    new = pairs & uncovered
    return len(new) + (HARD_WEIGHT - 1) * len(new & hard)


# --- the document ------------------------------------------------------------------------------

@dataclass
class Matrix:
    pairs: list[Pair]
    refused: dict[Pair, str]
    runs: list[Run]

    @classmethod
    def compute(cls) -> Matrix:
        pairs = all_pairs()
        refused = pair_refusals(pairs)
        allowed = [p for p in pairs if p not in refused]
        return cls(pairs, refused, covering_runs(allowed, refused))

    def run_of(self, pair: Pair) -> Run | None:
        return next((r for r in self.runs if pair in r.covers), None)


def _cell(matrix: Matrix, a: Level, b: Level) -> str:
    if a.factor == b.factor:
        return "·"
    pair = (a, b) if LEVELS.index(a) < LEVELS.index(b) else (b, a)
    if pair in matrix.refused:
        return "✗"
    run = matrix.run_of(pair)
    return str(run.index) if run else "?"


def _one_line(text: str) -> str:
    """`text` for a table cell: one line, no `|`, paths relative to the checkout (the doc is
    the same in every checkout)."""
    text = text.replace(f"{ROOT}{os.sep}", "")
    return re.sub(r"\s+", " ", text).replace("|", "\\|").strip()


def render(matrix: Matrix) -> str:
    """docs/composition.md."""
    parts = [HEADER.strip(), _features(), _matrix_table(matrix), _runs(matrix),
             _refusals(matrix)]
    return "\n\n".join(parts) + "\n"


def _features() -> str:
    out = ["## Features", "", "| level | kind | overrides |", "|---|---|---|"]
    for lv in LEVELS:
        text = " ".join(f"`{o}`" for o in lv.overrides) or "(none)"
        worlds = f" ({'/'.join(map(str, lv.worlds))} worker(s))" if lv.worlds else ""
        baseline = "" if lv.paired else ", the baseline: not paired"
        out.append(f"| {lv.key} | {lv.kind}{worlds}{baseline} | {_one_line(text)} |")
    return "\n".join(out)


def _matrix_table(matrix: Matrix) -> str:
    out = ["## Matrix", "", "Row and column *i* are level *i*. A number: the run that trains the "
           "pair first; ✗: refused (see below); ·: two levels of one factor.", "",
           "| | " + " | ".join(str(i + 1) for i in range(len(PAIRED))) + " |",
           "|---" * (len(PAIRED) + 1) + "|"]
    for i, a in enumerate(PAIRED):
        out.append(f"| {i + 1} {a.key} | " + " | ".join(_cell(matrix, a, b) for b in PAIRED)
                   + " |")
    out += ["", f"refused pairs: {len(matrix.refused)} of {len(matrix.pairs)}"]
    return "\n".join(out)


def _runs(matrix: Matrix) -> str:
    out = ["## Runs", "",
           "Every run below trains 3 steps: the vLLM venv's runs in CI (.ci/run: "
           "`pytest -m \"vllm and composition\"`), the others in the slow tier (.ci/slow: "
           "`pytest -m composition` in the main venv).",
           "",
           "Parity: the run equals the named 1-worker run at this relative "
           "tolerance, step by step.", "", "| run | workers | levels | parity |",
           "|---|---|---|---|"]
    for run in matrix.runs:
        rel = f"{run.combo.rel():.0e}".replace("e-0", "e-")
        parity = (f"= run {run.reference} (rel {rel})" if run.reference
                  else "is 1 worker" if not needs_reference(run.combo) else "none accepted")
        venv = " (vLLM venv)" if run.combo.vllm else ""
        out.append(f"| {run.index}{venv} | {run.world} | {run.combo.label} | {parity} |")
    return "\n".join(out)


def _refusals(matrix: Matrix) -> str:
    out = ["## Refused pairs", ""]
    out += [f"- **{a.key} × {b.key}**: {_one_line(why)}" for (a, b), why in matrix.refused.items()]
    return "\n".join(out)


HEADER = """
# Composition matrix

Which of dagrl's features run together, asked of the code itself. Generated by
`tests/test_composition.py`: the default suite fails when this page differs from what the
components say now, and

    DAGRL_WRITE_COMPOSITION=1 python -m pytest -q tests/test_composition.py -k doc

rewrites it (after a refusal is lifted or a feature added).

Each feature is a *level*: the `dagrl train` overrides that turn it on, on the tiny default
model. The levels of one *factor* exclude each other (a run has one rollout backend, launcher,
reward source, algorithm and multi-turn kind); the other features are on or off. A *pair* is two
levels of two factors. Which pairs are refused is not listed anywhere: each pair is handed to the
components a launch runs before any model loads (the config loader, the planner, the rollout
backend's check, the launch pre-flight, the engine layouts of each side and policy), and each
refusal below is the refusing component's own message. The allowed pairs are covered by a seeded
greedy pairwise covering array of runs, each accepted by the components as a whole; a run that
adds layouts to its other levels comes with the 1-worker run of those levels, which is a run of
the array too.

    python -m pytest -q -m composition tests/test_composition.py      # the runs (main venv)
    python -m pytest -q -m "vllm and composition" tests/test_composition.py   # vLLM venv

train each run for 3 steps with its launcher and check: every step's metrics present and
finite, each level's own metrics (or files) present, and the run equal to its 1-worker run
(reward, response length, policy loss, gradient norm; the tolerance of the existing parity test
of its loosest layout). `builtin:tiny-digit-rm` is trained once into dagrl's cache
($DAGRL_CACHE_DIR) and copied into each run; `{server_url}` is a `vllm serve` of the tiny
policy on 127.0.0.1 that the test starts.

Kinds: *semantic* changes what a step computes; *layout* only where and how (the run must
reproduce 1 worker); *observer* records (validation, the profiler: kept in the 1-worker run);
*launcher* starts the workers (in-process: 1 worker; Ray and torchrun: 2, or 4 or 8 where the
levels need them: HSDP under tensor parallelism is 2 replicas x 2 shards x tp 2, async HSDP
needs 4 trainer ranks in 2 groups beside the rollout ranks, and async tp or sp a trainer side of
tp x sp ranks).

The features are those of issue 34's list: the rollout backends, async, the two multi-turn
kinds, LoRA, TP, SP, HSDP, offload, a second policy, the reward sources, DAPO's filter, PPO's
critic, validation, the profiler, and 2 workers under Ray and under torchrun. One worker in the
test's process (launcher=in-process) is not a feature but the baseline every layout run is
compared with: it runs (as the reference runs below) and is not paired. What it cannot hold is
what one rank cannot: async (rollout and training on different ranks), TP, SP, HSDP and offload
(shards over 2+ ranks) need 2 workers or more, which the components say in one line each.
"""
