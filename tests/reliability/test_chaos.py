"""kill -9 anywhere in the composed recipes loses nothing (issue 38; the harness: tests/chaos.py).

DAGRL_CHAOS_KILLS trials (default 2: CI's), trial i with seed DAGRL_CHAOS_SEED + i (default 28);
the seed picks the recipe, the process and the moment. DAGRL_CHAOS_LOG=FILE appends each trial's
record as a JSON line (docs/reliability.md's table of 30 came from it); DAGRL_CHAOS_RECIPES=a,b
picks recipes. The vLLM recipe joins where vLLM is installed (the vLLM venv's run)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests import chaos

KILLS = int(os.environ.get("DAGRL_CHAOS_KILLS", "2"))
SEED = int(os.environ.get("DAGRL_CHAOS_SEED", "28"))   # 28, 29: async + tools, rank 0, rank 1
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# DAGRL_CHAOS_RECIPES=a,b: only those recipes (default: every recipe this venv can run).
CHOSEN = [n for n in os.environ.get("DAGRL_CHAOS_RECIPES", "").split(",") if n]
RECIPES = [r for r in chaos.RECIPES.values()
           if (HAVE_VLLM or not r.vllm) and (not CHOSEN or r.name in CHOSEN)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each deterministic recipe run once without a kill, when a trial first needs it."""
    cache: dict[str, list[dict]] = {}

    def get(recipe: chaos.Recipe) -> list[dict] | None:
        if not recipe.deterministic:
            return None
        if recipe.name not in cache:
            cache[recipe.name] = chaos.reference_run(recipe, tmp_path_factory.mktemp(recipe.name))
        return cache[recipe.name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SEED, SEED + KILLS))
def test_a_random_kill_loses_nothing(tmp_path, seed, references):
    trial = chaos.plan_trial(seed, RECIPES)
    recipe = chaos.RECIPES[trial.recipe]
    trial = chaos.run_trial(trial, recipe, tmp_path, references(recipe))
    if os.environ.get("DAGRL_CHAOS_LOG"):
        with open(os.environ["DAGRL_CHAOS_LOG"], "a") as f:
            f.write(json.dumps(trial.row()) + "\n")
    assert not trial.problems, trial.row()
